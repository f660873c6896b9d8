"""Pictures of the report step, registered for the HTML report with their
captions, and the labels and sweep points the step is given. (EXPERIMENTS is
defined in common.smk, included before.)"""


def curve_plot(exp):
    """The learning-curve plot of one experiment, registered for the HTML report."""
    return report(
        f"results/plots/curves/{exp}.png",
        caption="../report/curves.rst",
        category="Learning curves",
        labels={"experiment": exp},
    )


def curve_plots():
    return [curve_plot(exp) for exp in EXPERIMENTS]


def sweep_plot(name):
    """The chart of one sweep: the ranking metric against the swept value."""
    return report(
        f"results/plots/sweeps/{name}.png",
        caption="../report/sweep.rst",
        category="Sweeps",
        labels={"sweep": name},
    )


def sweep_plots():
    return [sweep_plot(name) for name in config["sweeps"]]


def sweep_points():
    """For the report: each sweep's grid keys (as in the experiment names) and the
    point of every experiment it made."""
    sweeps = {
        name: {"keys": [k.rsplit(".", 1)[-1] for k in sweep["grid"]], "points": {}}
        for name, sweep in config["sweeps"].items()
    }
    for exp, spec in EXPERIMENTS.items():
        if "point" in spec:
            sweeps[spec["sweep"]]["points"][exp] = spec["point"]
    return sweeps


def report_labels():
    """What the leaderboard shows of each experiment besides its metrics."""
    return {
        name: {
            "config": spec["config"],
            "overrides": spec["overrides"],
            "model": exported_model(name),  # chains.smk
        }
        for name, spec in EXPERIMENTS.items()
    }

"""The report step: leaderboard, pictures (drawn from made-up records and read
back from the figures), and `snakemake --report` on a finished run."""

from __future__ import annotations

import json
import sys
import tomllib

import matplotlib
import pandas as pd
import pytest

from tests.workflow.helpers import REPO, copy_finished, snakemake

matplotlib.use("Agg")
sys.path.insert(0, str(REPO / "workflow" / "scripts"))
import report  # noqa: E402  (workflow/scripts/report.py)
import report_plots  # noqa: E402


def test_leaderboard_ranking_options(tmp_path):
    experiments = {"a": {"config": "x", "overrides": ["k=1"]}, "b": {"config": "y", "overrides": []},
                   "c": {"config": "z", "overrides": []}}
    files = []
    for name, metrics in (("a", {"err": 0.3, "acc": 0.5}), ("b", {"err": 0.1, "acc": 0.9}),
                          ("c", {"acc": 0.7})):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(metrics))
    # null ranks by the first metric every experiment reports
    table, metric, columns = report.leaderboard(experiments, files, None, True)
    assert metric == "acc" and columns == ["err", "acc"]
    assert list(table["experiment"]) == ["b", "c", "a"] and list(table["rank"]) == [1, 2, 3]
    table, _, _ = report.leaderboard(experiments, files, "err", False)
    assert list(table["experiment"]) == ["b", "a", "c"]  # lowest first, missing last
    assert list(table["overrides"]) == ["", "k=1", ""]
    with pytest.raises(ValueError, match="leaderboard.metric: 'f1' is in no metrics.json"):
        report.leaderboard(experiments, files, "f1", True)


def history(epochs=5, steps=4):
    records = []
    for epoch in range(1, epochs + 1):
        for step in range(1, steps + 1):
            records.append({"split": "train", "epoch": epoch, "step": (epoch - 1) * steps + step,
                            "loss": 2 / (epoch + step / steps), "lr": 0.1})
        records.append({"split": "val", "epoch": epoch, "step": epoch * steps,
                        "loss": 1.5 / epoch, "accuracy": 0.9 + epoch / 100,
                        "macro_f1": 0.89 + epoch / 100})
    return records


def test_learning_curves_put_losses_and_metrics_on_labelled_axes_and_mark_the_best():
    fig = report_plots.draw_curves("exp", history(), best_epoch=4)
    loss_ax, metric_ax = fig.axes
    assert (loss_ax.get_ylabel(), metric_ax.get_ylabel()) == ("loss", "metric value")
    assert {line.get_label() for line in loss_ax.lines} >= {"train", "validation loss"}
    metric_labels = {line.get_label() for line in metric_ax.lines}
    assert {"accuracy", "macro_f1"} <= metric_labels and "validation loss" not in metric_labels
    for ax in fig.axes:
        assert "best.tar: epoch 4" in [line.get_label() for line in ax.lines]
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    accuracy, f1 = (next(line for line in metric_ax.lines if line.get_label() == k)
                    for k in ("accuracy", "macro_f1"))
    assert accuracy.get_marker() != f1.get_marker()  # one does not hide the other


def test_metric_chart_spans_the_data_and_names_the_ranking_metric():
    table = pd.DataFrame({"experiment": ["cnn", "mlp"], "accuracy": [0.9956, 0.98],
                          "loss": [0.05, 0.09]})
    fig = report_plots.draw_metrics(table, ["accuracy", "loss"], "accuracy", True)
    accuracy_ax, loss_ax = fig.axes
    low, high = accuracy_ax.get_xlim()
    assert 0.9 < low < 0.98 and 0.9956 < high < 1.01  # not from 0: the gap is visible
    assert "higher is better" in accuracy_ax.get_title() and "ranks" in accuracy_ax.get_title()
    assert "better" not in loss_ax.get_title()
    assert fig._suptitle.get_text()


def test_sweep_chart_has_the_swept_value_on_x():
    table = pd.DataFrame({"experiment": ["s/lr~0.1", "s/lr~0.01", "s/lr~0.001"],
                          "accuracy": [0.9, 0.95, 0.8]})
    sweep = {"keys": ["lr"], "points": {"s/lr~0.1": {"lr": 0.1}, "s/lr~0.01": {"lr": 0.01},
                                        "s/lr~0.001": {"lr": 0.001}}}
    fig = report_plots.draw_sweep("s", sweep, table, "accuracy", True)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "lr" and ax.get_xscale() == "log"
    assert ax.get_ylabel() == "accuracy (higher is better)"
    (line, best) = ax.lines
    assert list(line.get_xdata()) == [0.001, 0.01, 0.1]
    assert list(line.get_ydata()) == [0.8, 0.95, 0.9]
    assert best.get_label() == "best: lr=0.01"


def test_report_packages_are_dependencies():
    """`snakemake --report` needs pygments, which a plain install lacked."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0].strip().lower()
             for dep in project["dependencies"]}
    assert {"pygments", "snakemake"} <= names


def test_html_report_holds_captioned_plots_and_the_leaderboard_table(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    snakemake(wf, "--report", "report.html")
    html = (wf / "report.html").read_text()
    for text in ("Learning curves", "digits_cnn.png", "digits_mlp.png", "metrics.png",
                 "leaderboard.html", "leaderboard.csv",
                 "echelon3 trains every experiment",  # the workflow description
                 "The dashed red line marks",  # the learning curves' caption
                 "Each axis spans the values shown",  # the metric chart's caption
                 "Test-set metrics of every experiment"):  # the leaderboard's caption
        assert text in html, text
    table = (wf / "results/leaderboard.html").read_text()
    assert "<table" in table and "Ranked by <code>accuracy</code>, highest first" in table
    first, second, third = pd.read_csv(wf / "results/leaderboard.csv")["experiment"]
    assert table.index(f">{first}<") < table.index(f">{second}<") < table.index(f">{third}<")


def test_report_script_writes_every_output_of_the_rule(tmp_path):
    """report.main as Snakemake's script directive calls it: a sweep of two points
    and a plain experiment, histories and summaries beside the metrics."""
    from types import SimpleNamespace

    experiments = {"solo": {"config": "a", "overrides": []},
                   "s/lr~0.1": {"config": "a", "overrides": ["lr=0.1"]},
                   "s/lr~0.01": {"config": "a", "overrides": ["lr=0.01"]}}
    inputs = {"metrics": [], "summaries": []}
    histories = []
    for i, name in enumerate(experiments):
        folder = tmp_path / "results" / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"accuracy": 0.9 + i / 100}))
        (folder / "summary.json").write_text(json.dumps({"best": {"epoch": 2}}))
        (folder / "history.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in history(epochs=3)))
        inputs["metrics"].append(folder / "metrics.json")
        inputs["summaries"].append(folder / "summary.json")
        histories.append(folder / "history.jsonl")
    out = tmp_path / "out"
    outputs = SimpleNamespace(
        csv=out / "leaderboard.csv", md=out / "leaderboard.md", html=out / "leaderboard.html",
        bars=out / "metrics.png", curves=[out / f"curve{i}.png" for i in range(3)],
        sweeps=[out / "sweep.png"])
    out.mkdir()
    smk = SimpleNamespace(
        input=SimpleNamespace(**inputs), output=outputs, log=[tmp_path / "report.log"],
        params=SimpleNamespace(
            experiments=experiments, histories=histories, metric="accuracy",
            higher_is_better=True,
            sweeps={"s": {"keys": ["lr"], "points": {"s/lr~0.1": {"lr": 0.1},
                                                     "s/lr~0.01": {"lr": 0.01}}}}))
    report.main(smk)
    assert list(pd.read_csv(outputs.csv)["experiment"]) == ["s/lr~0.01", "s/lr~0.1", "solo"]
    for png in [outputs.bars, *outputs.curves, *outputs.sweeps]:
        assert png.read_bytes()[:4] == b"\x89PNG", png
    assert "Ranked by <code>accuracy</code>" in outputs.html.read_text()

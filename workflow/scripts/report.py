"""The workflow's report step: leaderboard (CSV, Markdown) and plots.

Run by Snakemake's `script:` directive; everything comes in through the
`snakemake` object: input.metrics and params.histories follow the order of
params.experiments.
"""

import json
import logging
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

log = logging.getLogger("report")


def read_metrics(path):
    with open(path) as f:
        metrics = json.load(f)
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: expected a JSON object of metric -> value")
    return {key: float(value) for key, value in metrics.items()}


def read_history(path):
    """Records of history.jsonl; a missing file or a torn last line is skipped."""
    records = []
    if not Path(path).is_file():
        log.warning("%s is missing: no learning curve", path)
        return records
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d is not JSON; skipped", path, number)
    return records


def leaderboard(experiments, metric_files, metric, higher_is_better):
    rows = []
    for (name, spec), path in zip(experiments.items(), metric_files):
        rows.append(
            {
                "experiment": name,
                "config": spec["config"],
                "overrides": " ".join(spec["overrides"]),
                **({"model": spec["model"]} if spec.get("model") else {}),
                **read_metrics(path),
            }
        )
    table = pd.DataFrame(rows)
    labels = ("experiment", "config", "overrides", "model")
    metric_columns = [c for c in table.columns if c not in labels]
    if metric is None:
        complete = [c for c in metric_columns if table[c].notna().all()]
        if not complete:
            raise ValueError("no metric is reported by every experiment; set leaderboard.metric")
        metric = complete[0]
    if metric not in metric_columns:
        raise ValueError(
            f"leaderboard.metric: '{metric}' is in no metrics.json "
            f"(found: {', '.join(metric_columns) or 'none'})"
        )
    table = table.sort_values(metric, ascending=not higher_is_better, kind="stable", na_position="last")
    table.insert(0, "rank", range(1, len(table) + 1))
    return table.reset_index(drop=True), metric, metric_columns


def markdown(table, metric, higher_is_better, folder="results"):
    """The table in Markdown; an exported model becomes a link relative to `folder`."""
    order = "highest" if higher_is_better else "lowest"
    if "model" in table.columns:
        table = table.assign(model=[
            f"[{Path(m).name}]({os.path.relpath(m, folder)})" if isinstance(m, str) else ""
            for m in table["model"]
        ])
    body = table.to_markdown(index=False, floatfmt=".4g")
    return f"# Leaderboard\n\nRanked by `{metric}`, {order} first.\n\n{body}\n"


def plot_curves(name, records, path):
    """Training loss per step, validation metrics per epoch."""
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    val = [r for r in records if r.get("split") == "val"]
    val_keys = sorted({k for r in val for k in r if k not in ("split", "epoch", "step")})
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    loss_ax, val_ax = axes
    if train:
        loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    loss_ax.set(title="training loss", xlabel="step", ylabel="loss")
    for key in val_keys:
        points = [(r["epoch"], r[key]) for r in val if isinstance(r.get(key), (int, float))]
        if points:
            val_ax.plot(*zip(*points), marker="o", ms=3, label=key)
    val_ax.set(title="validation", xlabel="epoch")
    if val_keys:
        val_ax.legend(fontsize="small")
    for ax in axes:
        if not ax.has_data():
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
    fig.suptitle(name)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_metrics(table, metric_columns, path):
    """One horizontal bar panel per metric, experiments in leaderboard order."""
    n = len(metric_columns)
    height = 0.4 * len(table) + 1.2
    fig, axes = plt.subplots(1, max(n, 1), figsize=(4 * max(n, 1), height), squeeze=False)
    names = table["experiment"][::-1]
    for ax, column in zip(axes[0], metric_columns):
        bars = ax.barh(names, table[column][::-1])
        ax.bar_label(bars, fmt="%.4g", padding=2, fontsize="small")
        ax.margins(x=0.2)
        ax.set_title(column)
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[0][1:]:
        ax.tick_params(labelleft=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(smk):
    logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(levelname)s %(message)s")
    experiments = smk.params.experiments
    metric, higher = smk.params.metric, smk.params.higher_is_better
    table, metric, metric_columns = leaderboard(experiments, smk.input.metrics, metric, higher)
    table.to_csv(smk.output.csv, index=False)
    Path(smk.output.md).write_text(markdown(table, metric, higher, Path(smk.output.md).parent))
    for name, history, png in zip(experiments, smk.params.histories, smk.output.curves):
        plot_curves(name, read_history(history), png)
    plot_metrics(table, metric_columns, smk.output.bars)
    log.info("ranked %d experiments by %s", len(table), metric)


if __name__ == "__main__":
    main(snakemake)  # noqa: F821 (injected by Snakemake's script directive)

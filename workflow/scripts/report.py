"""The workflow's report step: leaderboard (CSV, Markdown) and plots.

Run by Snakemake's `script:` directive, which puts this folder on sys.path
(report_plots.py draws the pictures); everything comes in through the
`snakemake` object: input.metrics, input.summaries, params.histories and
output.curves follow the order of params.experiments; output.sweeps that of
params.sweeps.
"""

import html
import json
import logging
import os
import sys
from pathlib import Path

import pandas as pd
from report_plots import draw_curves, draw_metrics, draw_sweep, save

log = logging.getLogger("report")


def read_metrics(path):
    try:
        with open(path) as f:
            metrics = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}); rerun its "
                         "evaluate job") from e
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: expected a JSON object of metric -> value")
    try:
        return {key: float(value) for key, value in metrics.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: every value must be a number ({e})") from e


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


HTML = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Leaderboard</title><style>
body {{ font: 14px sans-serif; margin: 1em; }}
table {{ border-collapse: collapse; }}
th, td {{ padding: 4px 12px; border-bottom: 1px solid #ddd; text-align: left; }}
tbody tr:first-child {{ background: #eef6ee; font-weight: bold; }}
</style></head><body>
<h2>Leaderboard</h2>
<p>Ranked by <code>{metric}</code>, {order} first (test set, <code>echelon3 evaluate</code>
on each run's best.tar).</p>
{table}
</body></html>
"""


def html_table(table, metric, higher_is_better, folder="results"):
    """The leaderboard as a small HTML page: the report shows HTML, not CSV. An
    exported model becomes a link relative to `folder`."""
    order = "highest" if higher_is_better else "lowest"
    cells = {c: lambda v: html.escape(str(v)) for c in table.select_dtypes("object")}
    if "model" in table.columns:
        cells["model"] = lambda m: (
            f'<a href="{html.escape(os.path.relpath(m, folder))}">{Path(m).name}</a>'
            if isinstance(m, str) and m else "")
    body = table.to_html(index=False, float_format=lambda v: f"{v:.4f}", na_rep="", border=0,
                         formatters=cells, escape=False)
    return HTML.format(metric=metric, order=order, table=body)


def best_epoch(path):
    """The epoch of best.tar, from the run's summary.json (None when unknown)."""
    try:
        with open(path) as f:
            return (json.load(f).get("best") or {}).get("epoch")
    except (OSError, ValueError):
        log.warning("%s is missing or not JSON: best epoch not marked", path)
        return None


def main(smk):
    logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(levelname)s %(message)s")
    experiments = smk.params.experiments
    metric, higher = smk.params.metric, smk.params.higher_is_better
    table, metric, metric_columns = leaderboard(experiments, smk.input.metrics, metric, higher)
    table.to_csv(smk.output.csv, index=False)
    Path(smk.output.md).write_text(markdown(table, metric, higher, Path(smk.output.md).parent))
    Path(smk.output.html).write_text(html_table(table, metric, higher,
                                                Path(smk.output.html).parent))
    for name, history, summary, png in zip(experiments, smk.params.histories,
                                           smk.input.summaries, smk.output.curves):
        save(draw_curves(name, read_history(history), best_epoch(summary)), png)
    save(draw_metrics(table, metric_columns, metric, higher), smk.output.bars)
    for (name, sweep), png in zip(smk.params.sweeps.items(), smk.output.sweeps):
        save(draw_sweep(name, sweep, table, metric, higher), png)
    log.info("ranked %d experiments by %s", len(table), metric)


if __name__ == "__main__":
    try:
        main(snakemake)  # noqa: F821 (injected by Snakemake's script directive)
    except (OSError, ValueError) as e:  # a file that cannot be read: one line naming it
        sys.exit(f"report: {e}")

"""The workflow's report step: leaderboard (CSV, Markdown, HTML) and plots.

Run by Snakemake's `script:` directive, which puts this folder on sys.path
(report_plots.py draws the pictures); everything comes in through the
`snakemake` object: input.metrics, input.summaries, params.histories and
output.curves follow the order of params.experiments; output.sweeps that of
params.sweeps; params.parents maps a fine-tuned experiment to the one it starts from.

The leaderboard keeps the two roles of data apart: `test <metric>` columns are
metrics.json (`echelon3 evaluate` on the test set), `val <metric>` is best.tar's
score on the validation data that chose it (summary.json), empty when the test set
chose it (`selected_on: test`: its test scores are optimistic).
"""

import html
import json
import logging
import os
import re
import sys
from pathlib import Path

import pandas as pd
from report_mlflow import COLUMN as MLFLOW, link, log_curves, read_run
from report_plots import draw_curves, draw_metrics, draw_sweep, save

log = logging.getLogger("report")

SELECTED_ON = "selected_on"  # metrics.json and summary.json: "val" or "test"
TABLE_DECIMALS = 4  # Markdown, HTML and the console
CSV_DECIMALS = 6  # float32 noise (1.0000001192092896) is not a digit worth keeping
GROUP = "group"  # runs ranked together: the same test data and metrics
LABELS = ("experiment", "config", "overrides", "model", SELECTED_ON, MLFLOW)


def test_column(metric):
    return f"test {metric}"


def val_column(metric):
    return f"val {metric}"


def read_metrics(path):
    """(metrics, selected_on or None) of a metrics.json."""
    try:
        with open(path) as f:
            metrics = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}); rerun its "
                         "evaluate job") from e
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: expected a JSON object of metric -> value")
    selected = metrics.pop(SELECTED_ON, None)
    if selected not in (None, "val", "test"):
        raise ValueError(f"{path}: {SELECTED_ON} must be 'val' or 'test', got {selected!r}")
    try:
        return {key: float(value) for key, value in metrics.items()}, selected
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: every value must be a number ({e})") from e


def counted_in_steps(path):
    """Whether summary.json says the run was counted in steps (``max_steps``)."""
    try:
        with open(path) as f:
            return "max_steps" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def read_summary(path):
    """summary.json's `best` record ({} when missing or unreadable)."""
    if path is None:
        return {}
    try:
        with open(path) as f:
            return json.load(f).get("best") or {}
    except (OSError, ValueError, AttributeError):
        log.warning("%s is missing or not JSON: no validation score, best epoch not marked",
                    path)
        return {}


def selection_score(best, metric):
    """best.tar's validation value of `metric` (a test metric's name): the same key, else
    the one validation metric of the same name in another set."""
    scores = best.get("metrics") or {}
    if metric in scores:
        return scores[metric]
    short = metric.rsplit("/", 1)[-1]
    same = [v for k, v in scores.items() if k.rsplit("/", 1)[-1] == short]
    return same[0] if len(same) == 1 else None


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


def _call(spec):
    """`Type(key=value, ...)` of a {module, type, config} entry."""
    if not isinstance(spec, dict) or "type" not in spec:
        return json.dumps(spec, sort_keys=True, default=str)
    args = ", ".join(f"{k}={v}" for k, v in sorted((spec.get("config") or {}).items()))
    return f"{spec['type']}({args})"


def comparable(metrics_path):
    """What a run's test numbers are comparable on, from the config.yaml beside them: its
    test data and its metrics (None when the run folder has no config.yaml)."""
    path = Path(metrics_path).parent / "config.yaml"
    if not path.is_file():
        return None
    try:
        import yaml

        cfg = yaml.safe_load(path.read_text()) or {}
    except Exception:
        return None
    test = (cfg.get("data") or {}).get("test")
    sets = {"": test} if isinstance(test, dict) and "type" in test else (test or {})
    data = "; ".join(f"{name}: {_call(s)}" if name else _call(s) for name, s in
                     (sets.items() if isinstance(sets, dict) else []))
    entries = cfg.get("metrics") or []
    entries = entries.items() if isinstance(entries, dict) else \
        [kv for item in entries if isinstance(item, dict) for kv in item.items()]
    metrics = ", ".join(f"{name}: {_call(s)}" for name, s in entries)
    return f"test data {data or 'none'}; metrics {metrics or 'none'}"


def leaderboard(experiments, metric_files, metric, higher_is_better, summary_files=None):
    """(table ranked best first, the ranking column, the test metric columns). Runs scored
    on other test data or other metrics (a 10-class run beside a binary one) are not
    ranked together: a `group` column numbers the comparable sets, largest first, and the
    rank restarts in each."""
    summaries = summary_files or [None] * len(metric_files)
    rows, bests = [], []
    for (name, spec), path, summary in zip(experiments.items(), metric_files, summaries):
        metrics, selected = read_metrics(path)
        best = read_summary(summary)
        bests.append(best)
        url = link(read_run(summary))  # the MLflow run, when the run was tracked
        rows.append(
            {
                "experiment": name,
                "config": spec["config"],
                "overrides": " ".join(spec["overrides"]),
                **({"model": spec["model"]} if spec.get("model") else {}),
                SELECTED_ON: selected or best.get(SELECTED_ON) or "test",
                **({MLFLOW: url} if url else {}),
                **{test_column(k): v for k, v in metrics.items()},
            }
        )
    table = pd.DataFrame(rows)
    columns = [c for c in table.columns if c not in LABELS]
    names = [c.removeprefix("test ") for c in columns]
    if metric is None:
        complete = [n for n, c in zip(names, columns) if table[c].notna().all()]
        if not complete:
            raise ValueError("no metric is reported by every experiment; set leaderboard.metric")
        metric = complete[0]
    if metric not in names:
        raise ValueError(
            f"leaderboard.metric: '{metric}' is in no metrics.json "
            f"(found: {', '.join(names) or 'none'})"
        )
    val = [selection_score(best, metric) if selected == "val" else None
           for best, selected in zip(bests, table[SELECTED_ON])]
    table.insert(table.columns.get_loc(SELECTED_ON) + 1, val_column(metric),
                 [float("nan") if v is None else float(v) for v in val])
    ranking = test_column(metric)
    kinds = [comparable(path) for path in metric_files]
    sizes = {kind: kinds.count(kind) for kind in kinds}
    order = sorted(dict.fromkeys(kinds), key=lambda kind: -sizes[kind])  # stable: first seen
    table = table.sort_values(ranking, ascending=not higher_is_better, kind="stable",
                              na_position="last")
    if len(order) > 1:
        table.insert(0, GROUP, [order.index(kinds[i]) + 1 for i in table.index])
        table.attrs[GROUP] = {g + 1: kind or "no config.yaml" for g, kind in enumerate(order)}
        table = table.sort_values(GROUP, kind="stable")
        table.insert(0, "rank", table.groupby(GROUP).cumcount() + 1)
    else:
        table.insert(0, "rank", range(1, len(table) + 1))
    return table.reset_index(drop=True), ranking, columns


def note(table):
    """What the page says about the data behind the numbers."""
    text = ("`test` columns: `echelon3 evaluate` of each run's best.tar on the test set; "
            "`val`: best.tar's score on the validation data that chose it.")
    if GROUP in table.columns:
        text += (" Runs scored on other test data or with other metrics are ranked apart, "
                 "each group on its own.")
    on_test = list(table.loc[table[SELECTED_ON] == "test", "experiment"])
    if on_test:
        text += (f" Selected on the test set (no validation data, so their test scores "
                 f"are optimistic): {', '.join(on_test)}.")
    return text


def rounded(table, decimals):
    return table.round({c: decimals for c in table.select_dtypes("number").columns
                        if c != "rank"})


def markdown(table, metric, higher_is_better, folder="results"):
    """The table in Markdown; an exported model becomes a link relative to `folder`."""
    order = "highest" if higher_is_better else "lowest"
    if "model" in table.columns:
        table = table.assign(model=[
            f"[{Path(m).name}]({os.path.relpath(m, folder)})" if isinstance(m, str) else ""
            for m in table["model"]
        ])
    if MLFLOW in table.columns:
        table = table.assign(**{MLFLOW: [f"[run]({u})" if isinstance(u, str) else ""
                                         for u in table[MLFLOW]]})
    def body(rows):  # a run without a metric shows a blank cell, not nan
        rows = rows.astype(object).where(rows.notna(), None)
        return rows.to_markdown(index=False, floatfmt=f".{TABLE_DECIMALS}f", missingval="")

    head = f"# Leaderboard\n\nRanked by `{metric}`, {order} first.\n\n{note(table)}\n"
    if GROUP not in table.columns:
        return f"{head}\n{body(table)}\n"
    groups = table.attrs.get(GROUP, {})
    parts = [f"\n## Group {g}: {groups.get(g, '')}\n\n{body(rows.drop(columns=GROUP))}\n"
             for g, rows in table.groupby(GROUP, sort=True)]
    return head + "".join(parts)


HTML = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Leaderboard</title><style>
body {{ font: 14px sans-serif; margin: 1em; }}
table {{ border-collapse: collapse; }}
th, td {{ padding: 4px 12px; border-bottom: 1px solid #ddd; text-align: left; }}
tbody tr:first-child {{ background: #eef6ee; font-weight: bold; }}
</style></head><body>
<h2>Leaderboard</h2>
<p>Ranked by <code>{metric}</code>, {order} first.</p>
<p>{note}</p>
{table}
</body></html>
"""


def html_table(table, metric, higher_is_better, folder="results"):
    """The leaderboard as a small HTML page: the report shows HTML, not CSV. An
    exported model becomes a link relative to `folder`."""
    order = "highest" if higher_is_better else "lowest"
    cells = {c: lambda v: html.escape(str(v))
             for c in table.select_dtypes(include=["object", "string"]).columns}
    if "model" in table.columns:
        cells["model"] = lambda m: (
            f'<a href="{html.escape(os.path.relpath(m, folder))}">{Path(m).name}</a>'
            if isinstance(m, str) and m else "")
    if MLFLOW in table.columns:
        cells[MLFLOW] = lambda u: (f'<a href="{html.escape(u)}">run</a>'
                                   if isinstance(u, str) and u else "")
    body = table.to_html(index=False, float_format=lambda v: f"{v:.{TABLE_DECIMALS}f}",
                         na_rep="", border=0, formatters=cells, escape=False)
    words = html.escape(note(table))
    words = re.sub(r"`([^`]*)`", r"<code>\1</code>", words)
    return HTML.format(metric=html.escape(metric), order=order, note=words, table=body)


def main(smk):
    logging.basicConfig(filename=smk.log[0], level=logging.INFO, format="%(levelname)s %(message)s")
    experiments = smk.params.experiments
    metric, higher = smk.params.metric, smk.params.higher_is_better
    table, ranking, columns = leaderboard(experiments, smk.input.metrics, metric, higher,
                                          smk.input.summaries)
    rounded(table, CSV_DECIMALS).to_csv(smk.output.csv, index=False)
    shown = rounded(table, TABLE_DECIMALS)
    Path(smk.output.md).write_text(markdown(shown, ranking, higher, Path(smk.output.md).parent))
    Path(smk.output.html).write_text(html_table(shown, ranking, higher,
                                                Path(smk.output.html).parent))
    runs = {name: (read_history(history), read_summary(summary))
            for name, history, summary in zip(experiments, smk.params.histories,
                                              smk.input.summaries)}
    parents = getattr(smk.params, "parents", {}) or {}
    for name, png, summary in zip(experiments, smk.output.curves, smk.input.summaries):
        records, best = runs[name]
        parent = parents.get(name)
        chain = (parent, *runs[parent]) if parent in runs else None
        save(draw_curves(name, records, best.get("epoch"), best.get(SELECTED_ON, "test"),
                         parent=chain, best_step=best.get("step"),
                         by_steps=counted_in_steps(summary)), png)
    log_curves([read_run(s) for s in smk.input.summaries], smk.output.curves)
    save(draw_metrics(table, columns, ranking, higher), smk.output.bars)
    for (name, sweep), png in zip(smk.params.sweeps.items(), smk.output.sweeps):
        save(draw_sweep(name, sweep, table, ranking, higher), png)
    log.info("ranked %d experiments by %s", len(table), ranking)


if __name__ == "__main__":
    try:
        main(snakemake)  # noqa: F821 (injected by Snakemake's script directive)
    except (OSError, ValueError) as e:  # a file that cannot be read: one line naming it
        sys.exit(f"report: {e}")

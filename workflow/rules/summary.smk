"""What the workflow prints when it has finished: the top of the leaderboard and
where everything is."""

import pandas as pd

LEADERBOARD_ROWS = 5


def leaderboard_top(path="results/leaderboard.csv"):
    if not Path(path).is_file():
        return None
    table = pd.read_csv(path)
    shown = table.drop(columns=["config", "overrides", "mlflow"], errors="ignore")
    # the model's path last: the scores line up after the names
    shown = shown[
        [c for c in shown.columns if c != "model"] + ["model"] * ("model" in shown)
    ]
    text = shown.head(LEADERBOARD_ROWS).to_string(
        index=False, na_rep="", float_format="{:.4f}".format
    )
    more = len(table) - LEADERBOARD_ROWS
    return text + (f"\n... and {more} more in {path}" if more > 0 else "")


def finished_message():
    lines = []
    top = leaderboard_top()
    if top is not None:
        lines += ["Leaderboard (results/leaderboard.md, .csv, .html):", top, ""]
    lines += [
        "Results:  results/<experiment>/ (best.tar, metrics.json, predictions.csv, summary.json)",
        "Plots:    results/plots/",
        "Logs:     logs/<rule>/<experiment>.log",
        "Report:   snakemake --report report.html  (leaderboard and plots in one page)",
    ]
    return "\n".join(lines)


onsuccess:
    print(finished_message())

"""The report step: leaderboard, pictures (drawn from made-up records and read
back from the figures), and `snakemake --report` on a finished run."""

from __future__ import annotations

import json
import sys
import tomllib
import warnings

import matplotlib
import pandas as pd
import pytest
import yaml

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
    assert metric == "test acc" and columns == ["test err", "test acc"]
    assert list(table["experiment"]) == ["b", "c", "a"] and list(table["rank"]) == [1, 2, 3]
    table, _, _ = report.leaderboard(experiments, files, "err", False)
    assert list(table["experiment"]) == ["b", "a", "c"]  # lowest first, missing last
    assert list(table["overrides"]) == ["", "k=1", ""]
    with pytest.raises(ValueError, match="leaderboard.metric: 'f1' is in no metrics.json"):
        report.leaderboard(experiments, files, "f1", True)



def test_runs_on_other_test_data_or_metrics_are_ranked_apart_and_missing_is_blank(tmp_path):
    """Two 10-class digits runs and a binary one, each folder with its config.yaml: the
    binary run is not ranked among the others; a metric a run lacks is a blank cell."""
    digits = {"module": "echelon3.datasets.digits", "type": "Digits",
              "config": {"split": "test"}}
    ten = [{"accuracy": {"module": "torchmetrics.classification", "type": "MulticlassAccuracy",
                         "config": {"num_classes": 10}}}]
    two = [{"accuracy": {"module": "torchmetrics.classification", "type": "BinaryAccuracy"}}]
    runs = {"mlp": (ten, {"accuracy": 0.95, "loss": 0.2}), "cnn": (ten, {"accuracy": 0.97}),
            "parity": (two, {"accuracy": 0.99, "loss": 0.1})}
    experiments, files = {}, []
    for name, (metrics, scores) in runs.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump({"data": {"test": digits},
                                                            "metrics": metrics}))
        files.append(folder / "metrics.json")
        files[-1].write_text(json.dumps(scores))
        experiments[name] = {"config": name, "overrides": []}
    table, ranking, _ = report.leaderboard(experiments, files, "accuracy", True)
    assert list(zip(table["group"], table["rank"], table["experiment"])) == [
        (1, 1, "cnn"), (1, 2, "mlp"), (2, 1, "parity")]  # 0.99 is not above the digits runs
    md = report.markdown(report.rounded(table, report.TABLE_DECIMALS), ranking, True)
    assert "nan" not in md
    first, second = md.split("## Group 2: ")
    assert "## Group 1: test data Digits(split=test); metrics accuracy: " \
           "MulticlassAccuracy(num_classes=10)" in first and "BinaryAccuracy()" in second
    cnn = next(line for line in first.splitlines() if "| cnn " in line)
    assert cnn.rstrip().endswith("|") and cnn.split("|")[-2].strip() == ""  # no loss: blank

def test_leaderboard_keeps_the_selection_score_and_the_test_score_apart(tmp_path):
    """`val <metric>` is best.tar's score on the data that chose it (summary.json), empty
    for a run the test set chose; `test <metric>` is metrics.json; every table says which
    runs were selected on the test set, and float32 noise is rounded away."""
    experiments = {"on_val": {"config": "x", "overrides": []},
                   "on_test": {"config": "y", "overrides": []}}
    runs = {"on_val": ({"accuracy": 0.97, "loss": 0.1, "selected_on": "val"},
                       {"best": {"epoch": 3, "metrics": {"accuracy": 0.99, "loss": 0.05},
                                 "selected_on": "val"}}),
            "on_test": ({"accuracy": 1.0000001192092896, "loss": 0.2, "selected_on": "test"},
                        {"best": {"epoch": 2, "metrics": {"accuracy": 1.0, "loss": 0.2},
                                  "selected_on": "test"}})}
    metric_files, summary_files = [], []
    for name, (metrics, summary) in runs.items():
        metric_files.append(tmp_path / f"{name}.metrics.json")
        metric_files[-1].write_text(json.dumps(metrics))
        summary_files.append(tmp_path / f"{name}.summary.json")
        summary_files[-1].write_text(json.dumps(summary))
    table, ranking, columns = report.leaderboard(experiments, metric_files, "accuracy", True,
                                                 summary_files)
    assert ranking == "test accuracy" and columns == ["test accuracy", "test loss"]
    assert list(table.columns) == ["rank", "experiment", "config", "overrides", "selected_on",
                                   "val accuracy", "test accuracy", "test loss"]
    rows = table.set_index("experiment")
    assert rows.loc["on_val", "val accuracy"] == 0.99  # summary.json, not metrics.json
    assert rows.loc["on_val", "test accuracy"] == 0.97
    assert pd.isna(rows.loc["on_test", "val accuracy"])  # no validation data: no val score
    assert list(rows["selected_on"]) == ["test", "val"]  # ranked by the test score
    shown = report.rounded(table, report.TABLE_DECIMALS)
    md = report.markdown(shown, ranking, True)
    assert "Selected on the test set (no validation data" in md and "on_test." in md
    assert "1.0000" in md and "1.0000001" not in md
    page = report.html_table(shown, ranking, True)
    assert "Selected on the test set" in page and "1.0000001" not in page
    csv_file = tmp_path / "leaderboard.csv"
    report.rounded(table, report.CSV_DECIMALS).to_csv(csv_file, index=False)
    assert "1.0000001" not in csv_file.read_text()
    assert pd.read_csv(csv_file)["test accuracy"].tolist() == [1.0, 0.97]


def test_metrics_json_may_say_what_selected_its_checkpoint_and_nothing_else(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"accuracy": 0.9, "selected_on": "val"}))
    assert report.read_metrics(path) == ({"accuracy": 0.9}, "val")
    path.write_text(json.dumps({"accuracy": 0.9, "selected_on": "train"}))
    with pytest.raises(ValueError, match="selected_on must be 'val' or 'test'"):
        report.read_metrics(path)


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
    assert "lower is better" in loss_ax.get_title()
    assert metric_ax.get_title() == "validation metrics"


def test_a_validation_in_the_middle_of_an_epoch_sits_there_and_so_does_its_best():
    """Two validations an epoch (steps 2 and 4 of 4): the first of epoch 2 sits at 1.5, and
    a best.tar it chose is marked there, labelled with the epoch its record names."""
    records = []
    for epoch in (1, 2, 3):
        for step in (1, 2, 3, 4):
            at = (epoch - 1) * 4 + step
            records.append({"split": "train", "epoch": epoch, "step": at, "loss": 1 / at})
            if step % 2 == 0:
                records.append({"split": "val", "epoch": epoch, "step": at, "loss": 1 / at,
                                "accuracy": at / 20})
    fig = report_plots.draw_curves("exp", records, best_epoch=2, best_step=6)
    loss_ax, metric_ax = fig.axes
    lines = {line.get_label(): line for line in metric_ax.lines}
    assert list(lines["accuracy"].get_xdata()) == [0.5, 1, 1.5, 2, 2.5, 3]
    assert list(lines["best.tar: epoch 2"].get_xdata()) == [1.5, 1.5]
    steps = report_plots.draw_curves("exp", records, best_epoch=2, best_step=6, by_steps=True)
    lines = {line.get_label(): line for line in steps.axes[1].lines}  # a run counted in steps
    assert list(lines["accuracy"].get_xdata()) == [2, 4, 6, 8, 10, 12]
    assert list(lines["best.tar: step 6"].get_xdata()) == [6, 6]
    assert steps.axes[0].get_xlabel() == "step"
    child = [{"split": "val", "epoch": 1, "step": 4, "loss": 0.1, "accuracy": 0.99}]
    fig = report_plots.draw_curves("ft", child, best_epoch=1, best_step=4,
                                   parent=("base", records, {"epoch": 2, "step": 6}))
    lines = {line.get_label(): line for line in fig.axes[1].lines}
    assert list(lines["fine-tuning starts (base best.tar)"].get_xdata()) == [1.5, 1.5]
    assert list(lines["base: accuracy"].get_xdata()) == [0.5, 1, 1.5]  # up to its best.tar
    assert list(lines["accuracy"].get_xdata()) == [2.5]


def test_train_records_with_a_throughput_add_a_panel_of_tokens_per_second_and_mfu():
    records = history(epochs=2, steps=2)
    for r in records:
        if r["split"] == "train":
            r.update(samples_per_s=10.0 * r["step"], tokens_per_s=50.0 * r["step"],
                     mfu=0.01 * r["step"])
    fig = report_plots.draw_curves("exp", records, best_epoch=2)
    loss_ax, metric_ax, speed_ax, mfu_ax = fig.axes
    (rate,) = speed_ax.lines
    assert speed_ax.get_ylabel() == "tokens/s" and list(rate.get_ydata()) == [50, 100, 150, 200]
    assert list(mfu_ax.lines[0].get_ydata()) == pytest.approx([1, 2, 3, 4])  # in percent
    assert len(report_plots.draw_curves("exp", history(), best_epoch=2).axes) == 2


def test_curves_of_a_run_selected_on_the_test_set_say_test():
    fig = report_plots.draw_curves("exp", history(), best_epoch=4, selected_on="test")
    loss_ax, metric_ax = fig.axes
    labels = {line.get_label() for line in loss_ax.lines}
    assert "test loss" in labels and "validation loss" not in labels
    assert "the test set chose best.tar" in metric_ax.get_title()


def test_a_fine_tuned_run_continues_its_parents_curve():
    """The child (2 epochs) starts from the parent's best.tar (epoch 4 of 5): its points
    sit at epochs 5 and 6 after the parent's first 4, and a flat pair of values keeps
    an honest axis with the numbers written beside the points."""
    child = [{"split": "val", "epoch": e, "step": e, "loss": 0.1, "accuracy": 0.98 + e * 1e-5}
             for e in (1, 2)]
    fig = report_plots.draw_curves("ft", child, best_epoch=2,
                                   parent=("base", history(), {"epoch": 4}))
    loss_ax, metric_ax = fig.axes
    lines = {line.get_label(): line for line in metric_ax.lines}
    assert list(lines["accuracy"].get_xdata()) == [5, 6]
    assert list(lines["base: accuracy"].get_xdata()) == [1, 2, 3, 4]  # up to its best.tar
    assert "fine-tuning starts (base best.tar)" in lines
    assert list(lines["fine-tuning starts (base best.tar)"].get_xdata()) == [4, 4]
    assert list(lines["best.tar: epoch 2"].get_xdata()) == [6, 6]
    low, high = metric_ax.get_ylim()
    assert high - low > 0.05  # the parent's 0.91..0.94 and the child's 0.98 together
    alone = report_plots.draw_curves("ft", child, best_epoch=2)
    low, high = alone.axes[1].get_ylim()
    assert high - low >= 0.0098  # not 0.00012: the two points are as flat as they are
    assert {t.get_text() for t in alone.axes[1].texts} == {"0.9800", "0.9800"}


def test_metric_chart_spans_the_data_and_names_the_ranking_metric():
    table = pd.DataFrame({"experiment": ["cnn", "mlp"], "accuracy": [0.9956, 0.98],
                          "loss": [0.05, 0.09]})
    fig = report_plots.draw_metrics(table, ["accuracy", "loss"], "accuracy", True)
    accuracy_ax, loss_ax = fig.axes
    low, high = accuracy_ax.get_xlim()
    assert 0.9 < low < 0.98 and 0.9956 < high < 1.01  # not from 0: the gap is visible
    assert "higher is better" in accuracy_ax.get_title() and "ranks" in accuracy_ax.get_title()
    assert loss_ax.get_title() == "loss\n(lower is better)"
    assert fig._suptitle.get_text()


def test_sweep_chart_has_the_swept_value_on_x():
    table = pd.DataFrame({"experiment": ["s/lr~0.1", "s/lr~0.01", "s/lr~0.001"],
                          "accuracy": [0.9, 0.95, 0.8]})
    sweep = {"keys": ["lr"], "points": {"s/lr~0.1": {"lr": 0.1}, "s/lr~0.01": {"lr": 0.01},
                                        "s/lr~0.001": {"lr": 0.001}}}
    fig = report_plots.draw_sweep("s", sweep, table, "accuracy", True)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "lr" and ax.get_xscale() == "log"
    assert ax.get_ylabel() == "accuracy (higher is better)"  # the column it is given
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
                 "validation data that chose",  # the leaderboard's caption
                 "selected_on"):
        assert text in html, text
    table = (wf / "results/leaderboard.html").read_text()
    assert "<table" in table and "Ranked by <code>test accuracy</code>, highest first" in table
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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pandas' deprecations included (Pandas4Warning)
        report.main(smk)
    assert list(pd.read_csv(outputs.csv)["experiment"]) == ["s/lr~0.01", "s/lr~0.1", "solo"]
    for png in [outputs.bars, *outputs.curves, *outputs.sweeps]:
        assert png.read_bytes()[:4] == b"\x89PNG", png
    assert "Ranked by <code>test accuracy</code>" in outputs.html.read_text()

"""A finished run of the workflow: its outputs, what it prints at the end, and
what a later change replans (an edited config, an override) or leaves alone
(resources)."""

from __future__ import annotations

import csv
import json
import re

import pytest
import yaml

from tests.workflow.conftest import EARLY, EPOCHS
from tests.workflow.helpers import CHAIN, RUN_S, copy_finished, jobs_for, planned, snakemake


def test_run_makes_every_output(finished):
    experiments = yaml.safe_load((finished / "config/config.yaml").read_text())["experiments"]
    assert set(experiments) == {"digits_cnn", "digits_mlp", "digits_mlp_ft"}
    for exp in experiments:
        folder = finished / "results" / exp
        assert (folder / "best.tar").is_file()
        metrics = json.loads((folder / "metrics.json").read_text())
        assert 0.8 < metrics["accuracy"] <= 1.0 and "macro_f1" in metrics
        with open(folder / "predictions.csv") as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == ["index", "prediction", *(f"score_{i}" for i in range(10))]
        assert len(rows) > 100
        summary = json.loads((folder / "summary.json").read_text())
        if "max_steps" in summary:  # counted in steps: 40 steps end inside the third epoch
            assert summary["steps"] == summary["max_steps"] == 40
            assert summary["epochs"] == 2 and summary["best"]["step"] == 40
        else:
            epochs = 2 if exp == EARLY else EPOCHS
            assert summary["epochs"] == epochs and 1 <= summary["best"]["epoch"] <= epochs
        png = finished / "results" / "plots" / "curves" / f"{exp}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (finished / "results/plots/metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert "<table" in (finished / "results/leaderboard.html").read_text()


def test_leaderboard_ranks_all_metrics_best_first(finished):
    with open(finished / "results/leaderboard.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["rank"] for r in rows] == ["1", "2", "3"]
    assert {r["experiment"] for r in rows} == {"digits_cnn", "digits_mlp", "digits_mlp_ft"}
    accuracies = [float(r["test accuracy"]) for r in rows]
    assert accuracies == sorted(accuracies, reverse=True)
    for row in rows:
        folder = finished / "results" / row["experiment"]
        metrics = json.loads((folder / "metrics.json").read_text())
        # the digits experiments choose best.tar on their validation split
        assert metrics.pop("selected_on") == row["selected_on"] == "val"
        assert {k: float(row[f"test {k}"]) for k in metrics} == pytest.approx(metrics, abs=1e-6)
        best = json.loads((folder / "summary.json").read_text())["best"]
        assert float(row["val accuracy"]) == pytest.approx(best["metrics"]["accuracy"], abs=1e-6)
        assert best["selected_on"] == "val"
    md = (finished / "results/leaderboard.md").read_text()
    assert "Ranked by `test accuracy`, highest first." in md
    assert "| selected_on | val accuracy | test accuracy |" in re.sub(" +", " ", md)
    lines = [line for line in md.splitlines() if line.startswith("|")]
    assert rows[0]["experiment"] in lines[2] and rows[1]["experiment"] in lines[3]


def test_second_dry_run_has_nothing_to_do(finished):
    out = snakemake(finished, "-n")
    assert "Nothing to be done" in out and planned(out) == set()
    # ... the experiment early stopping ended after epoch 2 of 3 included
    summary = json.loads((finished / f"results/{EARLY}/summary.json").read_text())
    assert summary["epochs"] == 2 and summary["stopped_early"].startswith(
        "stopped early after epoch 2")


def test_editing_an_experiment_config_replans_only_its_runs(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    cnn = wf / "config/experiments/digits_cnn.yaml"
    cnn.write_text(cnn.read_text() + "\n# edited\n")
    assert planned(snakemake(wf, "-n")) == jobs_for("digits_cnn")
    # a file both configs compose replans both
    wf2 = copy_finished(finished, tmp_path / "wf2")
    base = wf2 / "config/experiments/base/digits.yaml"
    base.write_text(base.read_text() + "\n# edited\n")
    assert planned(snakemake(wf2, "-n")) == jobs_for("digits_cnn", "digits_mlp") | CHAIN


def test_changed_resources_alone_do_not_rerun(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    config_file = wf / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["experiments"]["digits_mlp"]["resources"].update(cpus=1, mem_mb=8000, runtime=90)
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    assert "Nothing to be done" in snakemake(wf, "-n")


def test_changed_override_retrains_exactly_that_experiment(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    config_file = wf / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["experiments"]["digits_mlp"]["overrides"].append("optimizer.config.lr=0.02")
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    out = snakemake(wf, "-n")
    assert planned(out) == jobs_for("digits_mlp") | CHAIN  # the child follows its parent
    assert "Params have changed since last execution" in out

    cnn_best = wf / "results/digits_cnn/best.tar"
    cnn_mtime = cnn_best.stat().st_mtime_ns
    snakemake(wf, "-j1", timeout=RUN_S)
    log = (wf / "logs/train/digits_mlp.log").read_text()
    assert "Resuming from" not in log, "retrained from the old checkpoints"
    assert list((wf / "results/digits_mlp").glob("superseded-*/checkpoint-*.tar"))
    saved = yaml.safe_load((wf / "results/digits_mlp/config.yaml").read_text())
    assert saved["optimizer"]["config"]["lr"] == 0.02
    assert cnn_best.stat().st_mtime_ns == cnn_mtime
    child = (wf / "logs/train/digits_mlp_ft.log").read_text()
    assert "config changed since" in child and "starting over" in child  # new parent weights
    assert "Nothing to be done" in snakemake(wf, "-n")


def test_train_log_ends_with_a_summary_block(finished):
    log = (finished / "logs/train/digits_cnn.log").read_text()
    summary = json.loads((finished / "results/digits_cnn/summary.json").read_text())
    end = log[log.rindex(f"trained {EPOCHS} epochs in"):]
    best = summary["best"]
    assert f"best     epoch {best['epoch']} (step {best['step']}, selected on the validation " \
        "set): " in end
    assert f"accuracy {best['metrics']['accuracy']:.4f}" in end
    assert re.search(r"written  results/digits_cnn/: best\.tar, checkpoint-\d+\.tar, .*"
                     r"config\.yaml, history\.jsonl, summary\.json", end), end


def test_workflow_ends_with_the_leaderboard_and_where_things_are(finished):
    console = (finished / "console.txt").read_text()
    end = console[console.rindex("Leaderboard (results/leaderboard.md"):]
    with open(finished / "results/leaderboard.csv") as f:
        rows = list(csv.DictReader(f))
    top = end.splitlines()[2].split()
    assert top[:5] == ["1", rows[0]["experiment"], "val", f"{float(rows[0]['val accuracy']):.4f}",
                       f"{float(rows[0]['test accuracy']):.4f}"]
    # experiments without an export have an empty model cell, not "NaN"
    assert "NaN" not in end.split("Results:")[0]
    for line in ("Results:  results/<experiment>/", "Plots:    results/plots/",
                 "Report:   snakemake --report report.html"):
        assert line in end

"""echelon3.tasks.summary: the block that ends `echelon3 train`, summary.json, and no
half-made run folder after a failure before the first checkpoint."""

from __future__ import annotations

import json

from tests.helpers import echelon3, load, target, write_config


def test_train_ends_with_a_summary_block_and_summary_json(tmp_path, capsys):
    write_config(tmp_path)
    assert echelon3("train", tmp_path) == 0
    out = target(tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    best = load(out / "best.tar")
    assert summary["epochs"] == summary["epochs_trained"] == 2
    assert summary["best"] == {"epoch": best["epoch"], "step": best["global_step"],
                               "metrics": best["metrics"], "selected_on": "test"}
    assert summary["files"] == ["best.tar", "checkpoint-1.tar", "checkpoint-2.tar",
                                "config.yaml", "history.jsonl", "summary.json"]
    assert summary["elapsed_s"] > 0
    err = capsys.readouterr().err
    block = err[err.rindex("[echelon3] trained 2 epochs in "):].splitlines()
    accuracy = f"accuracy {best['metrics']['accuracy']:.4f}"
    assert block[1].startswith(f"  best     epoch {best['epoch']} (step {best['global_step']}, "
                               "selected on the test set): ")
    assert accuracy in block[1]
    assert block[2] == f"  written  {out}/: {', '.join(summary['files'])}"
    speed = summary["throughput"]  # 12 steps of 32 samples, the first record's 2 left out
    assert speed["steps_timed"] == 10 and speed["first_record_left_out"] is True
    assert block[3].startswith(f"  speed    {speed['samples_per_s']:.4g} samples/s, ")


def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing_of_it(tmp_path, capsys):
    write_config(tmp_path)
    # passes the pre-flight (a name), fails once the trainer knows its metrics
    assert echelon3("train", tmp_path, "trainer.config.keep_best_on=acuracy") == 2
    assert "keep_best_on" in capsys.readouterr().err
    out = target(tmp_path)
    # at most the run lock's hidden file (echelon3.checkpoints.lock) stays, which a rerun takes over
    assert not out.exists() or all(p.name.startswith(".echelon3.lock") for p in out.iterdir())
    assert echelon3("train", tmp_path) == 0  # and the rerun trains from scratch
    assert (target(tmp_path) / "summary.json").is_file()


def test_a_failure_after_a_checkpoint_keeps_the_run(tmp_path):
    write_config(tmp_path)
    assert echelon3("train", tmp_path) == 0
    assert echelon3("train", tmp_path, "trainer.config.epochs=3",
                    "trainer.config.keep_best_on=acuracy", "on_config_change=resume") == 2
    out = target(tmp_path)
    assert {"checkpoint-2.tar", "best.tar", "config.yaml", "history.jsonl"} <= \
        {p.name for p in out.iterdir()}
    assert not (out / "summary.json").exists()  # not finished: the last attempt failed


def test_the_summary_says_what_this_attempt_trained(tmp_path, capsys):
    """A resumed run names the epochs it added; one with nothing left to do says so
    instead of 'finished 2 epochs in 0.1 s'."""
    write_config(tmp_path)
    assert echelon3("train", tmp_path) == 0
    capsys.readouterr()
    assert echelon3("train", tmp_path, "trainer.config.epochs=3") == 0
    err = capsys.readouterr().err
    assert "[echelon3] trained epoch 3 (resumed after epoch 2) in " in err
    summary = json.loads((target(tmp_path) / "summary.json").read_text())
    assert (summary["epochs"], summary["epochs_trained"]) == (3, 1)
    assert echelon3("train", tmp_path, "trainer.config.epochs=3") == 0
    err = capsys.readouterr().err
    assert "[echelon3] nothing trained: 3 epochs were already done (raise " \
        "trainer.config.epochs to train more)" in err
    assert " trained 3 epochs" not in err and "finished" not in err
    summary = json.loads((target(tmp_path) / "summary.json").read_text())
    assert (summary["epochs"], summary["epochs_trained"]) == (3, 0)


def test_trained_line_wording():
    from echelon3.tasks.summary import trained_line

    assert trained_line(1, 0, 0.5) == "trained 1 epoch in 0.5 s"
    assert trained_line(10, 4, 2.0) == "trained epochs 5-10 (resumed after epoch 4) in 2.0 s"
    assert trained_line(4, 4, 0.1).startswith("nothing trained: 4 epochs were already done")

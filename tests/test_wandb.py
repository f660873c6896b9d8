"""W&B tracking, offline (``mode: offline``; no network): a run trained in two attempts
(1 epoch, then extended to 2) read back from the ``.wandb`` files wandb wrote
(:mod:`tests.wandb_records`) and compared with ``history.jsonl``, value for value; a
resumed attempt that logs steps again after a rewind; trackers that fail."""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path

import pytest

from echelon3.observe.loggers import JsonlLogger
from echelon3.observe.wandb import STATE, Settings, Tracker
from tests.helpers import echelon3, write_config

pytest.importorskip("wandb", reason="the wandb extra: pip install -e '.[wandb]'")
from tests import wandb_records  # noqa: E402

RECORD_KEYS = ("split", "epoch", "step")


@pytest.fixture(scope="module")
def quiet_wandb(tmp_path_factory):
    """wandb's files under a temporary folder, no output, nothing sent anywhere."""
    folder = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DIR", str(folder))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_MODE", "offline")
        mp.delenv("WANDB_API_KEY", raising=False)
        yield folder


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, quiet_wandb):
    """A digits run tracked offline, trained 1 epoch, then extended to 2 in a second
    attempt: (run folder, wandb.json after each attempt)."""
    folder = tmp_path_factory.mktemp("tracked")
    write_config(folder, {"wandb": {"project": "digits", "mode": "offline"},
                          "data": {"train": {"config": {"limit": 96}},
                                   "test": {"config": {"limit": 32}}},
                          "trainer": {"config": {"epochs": 1, "log_every_n_steps": 1}}})
    assert echelon3("train", folder) == 0
    first = json.loads((folder / "out" / STATE).read_text())
    assert echelon3("train", folder, "trainer.config.epochs=2") == 0
    flush()
    return folder / "out", first, json.loads((folder / "out" / STATE).read_text())


def flush() -> None:
    """wandb's service writes the last run's file out when it stops (at exit, here now)."""
    import wandb

    wandb.teardown()


def expected_rows(history: Path) -> dict[int, dict[str, float]]:
    """``step -> {split/name: value}`` from history.jsonl, computed independently."""
    rows: dict[int, dict[str, float]] = {}
    for line in history.read_text().splitlines():
        record = json.loads(line)
        for name, value in record.items():
            if name not in RECORD_KEYS and isinstance(value, int | float) and \
                    not isinstance(value, bool):
                rows.setdefault(record["step"], {})[f"{record['split']}/{name}"] = value
    return rows


def sent(state: dict) -> list[Path]:
    return wandb_records.run_files(Path(state["dir"]), state["run_id"])


def test_every_metric_is_history_jsonls_each_step_sent_once(tracked):
    folder, first, last = tracked
    files = sent(last)
    assert len(files) == 2  # one per attempt, both of the one run
    rows = wandb_records.history(files)
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps))  # only up, none twice
    expected = expected_rows(folder / "history.jsonl")
    assert {row["_step"]: {k: v for k, v in row.items() if k != "_step"} for row in rows} \
        == expected
    assert {r["epoch"] for r in map(json.loads, (folder / "history.jsonl").read_text()
                                    .splitlines())} == {1, 2}


def test_the_resumed_attempt_continues_the_same_run(tracked):
    folder, first, last = tracked
    assert last["run_id"] == first["run_id"]
    assert [r.run_id for r in wandb_records.runs(sent(last))] == [last["run_id"]] * 2
    assert [r.project for r in wandb_records.runs(sent(last))] == ["digits"] * 2
    first_rows = wandb_records.history(sent(last)[:1])
    later_rows = wandb_records.history(sent(last)[1:])
    assert first_rows[-1]["_step"] == first["step"] < later_rows[0]["_step"]
    assert later_rows[-1]["_step"] == last["step"]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["wandb"]["run_id"] == last["run_id"] and summary["wandb"]["logged"] is True
    scores = wandb_records.summary(sent(last))
    assert scores["best/accuracy"] == summary["best"]["metrics"]["accuracy"]
    assert scores["best/step"] == summary["best"]["step"]


def test_a_rewound_attempt_sends_no_step_again(tmp_path, quiet_wandb):
    """After a kill the run resumes from an earlier checkpoint and logs steps again: W&B
    keeps the first attempt's rows and gets only the steps beyond them."""
    settings = Settings("rewind", None, "offline", "r", None, str(tmp_path))

    def attempt(resumed, records, rewind=None):
        tracker = Tracker(settings, tmp_path)
        logger = tracker.watch(JsonlLogger(tmp_path / "history.jsonl"), resumed=resumed)
        if rewind is not None:
            logger.rewind(rewind)
        for record in records:
            logger.log(record)
        logger.close()
        tracker.finish({})
        return tracker.run_id

    first = attempt(False, [{"split": "train", "epoch": 1, "step": s, "loss": 10.0 + s}
                            for s in range(1, 7)])
    again = attempt(True, [{"split": "train", "epoch": 1, "step": s, "loss": 20.0 + s}
                           for s in range(4, 10)], rewind=3)
    assert again == first
    flush()
    rows = wandb_records.history(wandb_records.run_files(tmp_path, first))
    assert [(r["_step"], r["train/loss"]) for r in rows] == \
        [(s, 10.0 + s) for s in range(1, 7)] + [(s, 20.0 + s) for s in range(7, 10)]


def _fails(tmp_path, caplog, settings) -> dict:
    """A tracked attempt whose tracker fails: one warning; history.jsonl complete."""
    records = [{"split": "train", "epoch": 1, "step": s, "loss": 1 / s} for s in (1, 2, 3)]
    records.append({"split": "val", "epoch": 1, "step": 3, "accuracy": 0.5})
    tracker = Tracker(settings, tmp_path)
    with caplog.at_level(logging.WARNING, logger="echelon3.observe.wandb"):
        logger = tracker.watch(JsonlLogger(tmp_path / "history.jsonl"), resumed=False)
        for record in records:
            logger.log(record)
        logger.close()
        (tmp_path / "summary.json").write_text("{}")
        tracker.finish({"best": {"step": 3, "metrics": {"accuracy": 0.5}}})
    warnings = [r.getMessage() for r in caplog.records if r.name == "echelon3.observe.wandb"]
    assert len(warnings) == 1 and "W&B tracking (project p" in warnings[0], warnings
    assert "\n" not in warnings[0]
    assert [json.loads(line) for line in (tmp_path / "history.jsonl").read_text()
            .splitlines()] == records
    entry = json.loads((tmp_path / "summary.json").read_text())["wandb"]
    assert entry["logged"] is False
    return entry


def test_wandb_that_cannot_be_imported_is_one_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    entry = _fails(tmp_path, caplog, Settings("p", None, "offline", "r", None, str(tmp_path)))
    assert entry["error"].startswith("starting the run: ModuleNotFoundError")


def test_a_server_that_does_not_answer_is_one_warning(tmp_path, caplog, monkeypatch,
                                                      quiet_wandb):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    flush()  # the next start reads the environment again
    entry = _fails(tmp_path, caplog, Settings("p", None, "online", "r", None, str(tmp_path)))
    assert entry["error"].startswith("starting the run: ")


def test_a_bad_wandb_key_is_one_line_naming_it(tmp_path, capsys):
    write_config(tmp_path, {"wandb": {"projet": "x"}})
    assert echelon3("train", tmp_path) == 2
    err = capsys.readouterr().err
    assert "wandb.projet: unknown key (did you mean 'project'?)" in err, err
    assert "Traceback" not in err
    write_config(tmp_path, {"wandb": {"mode": "dryrun"}})
    assert echelon3("train", tmp_path) == 2
    assert "wandb.mode: must be online or offline, got 'dryrun'" in capsys.readouterr().err

"""A corrupt run folder: a torn history.jsonl line, a config.yaml edited by hand, a stray
file or folder named like a checkpoint. train, evaluate, run and the workflow's report
either work or stop with one line naming the file."""

from __future__ import annotations

import importlib.util
import logging
import shutil

import pytest

from tests.conftest import REPO
from tests.helpers import echelon3, history, load, target, write_config

PROMISE = "corrupt run folder: works, or one line naming the file"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-epoch run, copied by each test before it breaks something."""
    folder = tmp_path_factory.mktemp("finished")
    write_config(folder)
    assert echelon3("train", folder) == 0
    return folder


@pytest.fixture
def run(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    folder = tmp_path / "run"
    write_config(folder)  # target.path is the copy's
    return folder


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("echelon3:")]


def test_torn_history_hand_edited_config_and_stray_checkpoint_names(run, capfd, ledger):
    out = target(run)
    lines = (out / "history.jsonl").read_text().splitlines()
    lines[3] = lines[3][: len(lines[3]) // 2]  # torn in the middle of the file, not just the end
    (out / "history.jsonl").write_text("\n".join(lines) + '\n{"split": "tr')
    (out / "config.yaml").write_text("net: {module: [unclosed\n\tseed: ?\n")
    (out / "checkpoint-99.tar").write_bytes(b"not a checkpoint")
    (out / "checkpoint-98.tar").mkdir()
    (out / "checkpoint-97.tar").symlink_to(out / "nowhere")
    for task in ("train", "evaluate", "run"):
        assert echelon3(task, run, "trainer.config.epochs=3") == 0, task
    assert _errors(capfd.readouterr().err) == []
    assert load(out / "checkpoint-3.tar")["epoch"] == 3
    assert max(r["epoch"] for r in history(out)) == 3
    assert "module: echelon3.nets.mlp" in (out / "config.yaml").read_text()  # rewritten
    ledger(PROMISE, trials=1, faults=5)


def test_only_unloadable_checkpoints_stop_with_the_file_named(run, capfd, ledger):
    out = target(run)
    for path in [*out.glob("*.tar"), out / ".best.tar"]:
        path.write_bytes(b"junk")
    for task in ("train", "evaluate", "run"):
        assert echelon3(task, run) == 2, task
        (line,) = _errors(capfd.readouterr().err)
        assert ".tar: cannot load checkpoint" in line.split(";")[0], line
    ledger(PROMISE, trials=3, faults=3)


@pytest.fixture
def report(monkeypatch):
    """The workflow's report script, imported as Snakemake's ``script:`` runs it."""
    scripts = REPO / "workflow" / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("report", scripts / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_reads_a_torn_history(run, report, caplog, ledger):
    out = target(run)
    text = (out / "history.jsonl").read_text()
    (out / "history.jsonl").write_text(text[: len(text) - 7])
    caplog.set_level(logging.WARNING)
    records = report.read_history(out / "history.jsonl")
    assert len(records) == len(text.splitlines()) - 1
    assert any(f"{out / 'history.jsonl'}:" in r.getMessage() for r in caplog.records)
    ledger(PROMISE, trials=1, faults=1)


@pytest.mark.parametrize("text", ['{"accuracy": 0.9', '[1, 2]', '{"accuracy": "high"}'])
def test_the_report_names_a_corrupt_metrics_file(tmp_path, report, ledger, text):
    path = tmp_path / "metrics.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{path}: "):
        report.read_metrics(path)
    ledger(PROMISE, trials=1, faults=1)

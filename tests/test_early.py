"""echelon3.tasks.early: a finished run, a changed config and an evaluate / run with no
checkpoint are settled by the launcher, with no worker started (neither spawned nor run
in-process), saying and writing what a worker says and writes."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from echelon3.distributed import launch, runtime
from echelon3.tasks import early
from tests.helpers import echelon3, load, target, write_config


class WorkerStarted(Exception):
    pass


@pytest.fixture
def no_worker(monkeypatch):
    """Any worker, spawned or in this process, fails the test; the calls are counted."""
    started = []

    def refuse(*args, **kwargs):
        started.append(args)
        raise WorkerStarted

    monkeypatch.setattr(launch, "spawn", refuse)
    monkeypatch.setattr(runtime, "run_worker", refuse)
    return started


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finished")
    write_config(folder)
    assert echelon3("train", folder) == 0
    return folder


def _copy(run, folder):
    shutil.copytree(target(run), target(folder))
    write_config(folder)
    return target(folder)


def _summary(out) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k not in ("elapsed_s", "finished")}


def _as_a_workflow_rerun_leaves_it(out):
    """Snakemake deletes a job's outputs before it runs it again; the attempt before had
    logged past its newest checkpoint."""
    (out / "best.tar").unlink()
    (out / "summary.json").unlink()
    with open(out / "history.jsonl", "a") as f:
        f.write('{"split": "train", "epoch": 3, "step": 13, "loss": 1.0}\n{"split": "tr')


@pytest.mark.parametrize("length,rerun", [((), False), (("trainer.config.max_steps=12",), False),
                                          ((), True)],
                         ids=["epochs", "max_steps", "workflow_rerun"])
def test_a_finished_run_is_settled_as_a_worker_settles_it(finished_run, tmp_path, capsys,
                                                           monkeypatch, length, rerun):
    # What the worker's train task says and writes, with the launcher's answer turned off
    worker = _copy(finished_run, tmp_path / "worker")
    if rerun:
        _as_a_workflow_rerun_leaves_it(worker)
    with monkeypatch.context() as m:
        m.setattr(early, "finished", lambda command, rc: False)
        assert echelon3("train", tmp_path / "worker", *length) == 0
    said = capsys.readouterr().err
    out = _copy(finished_run, tmp_path / "launcher")
    if rerun:
        _as_a_workflow_rerun_leaves_it(out)
    before = {p.name: p.read_bytes() for p in out.glob("checkpoint-*.tar")}
    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a))
    monkeypatch.setattr(runtime, "run_worker", lambda *a, **k: started.append(a))
    for nproc in ("nproc=1", "nproc=2"):
        assert echelon3("train", tmp_path / "launcher", *length, nproc) == 0
        err = capsys.readouterr().err
        assert started == [], nproc
        why = "12 of 12 steps" if length else "2 of 2 epochs"
        assert f"[echelon3] nothing to train: {why} already done" in err
        closing = said[said.index("nothing trained: "):].replace(str(worker), str(out))
        assert err[err.index("nothing trained: "):] == closing
        assert _summary(out) == _summary(worker)
        assert {p.name: p.read_bytes() for p in out.glob("checkpoint-*.tar")} == before
        assert (out / "best.tar").read_bytes() == (worker / "best.tar").read_bytes()
        assert (out / "history.jsonl").read_text() == (worker / "history.jsonl").read_text()
        written = yaml.safe_load((out / "config.yaml").read_text())  # written again
        assert written.pop("nproc") == int(nproc[-1])
        assert written == yaml.safe_load((worker / "config.yaml").read_text().replace(
            str(worker), str(out)))
    state = load(out / "checkpoint-2.tar")
    assert (_summary(out)["epochs"], _summary(out)["steps"]) == (state["epoch"],
                                                                 state["global_step"])


def test_a_run_with_epochs_left_still_goes_to_the_workers(finished_run, tmp_path, no_worker):
    _copy(finished_run, tmp_path)
    with pytest.raises(WorkerStarted):
        echelon3("train", tmp_path, "trainer.config.epochs=3")
    with pytest.raises(WorkerStarted):
        echelon3("train", tmp_path, "nproc=2", "trainer.config.epochs=3")
    assert len(no_worker) == 2


@pytest.mark.parametrize("nproc", ["nproc=1", "nproc=2"])
def test_a_changed_config_is_refused_before_any_worker(finished_run, tmp_path, capsys,
                                                       no_worker, nproc):
    _copy(finished_run, tmp_path)
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.01", nproc) == 2
    err = capsys.readouterr().err
    assert no_worker == [] and err.count("echelon3: error:") == 1, err
    assert "optimizer.config.lr: 0.05 -> 0.01" in err.strip().splitlines()[-1]
    assert "on_config_change" in err


@pytest.mark.parametrize("command", ["evaluate", "run"])
def test_evaluate_and_run_with_no_checkpoint_start_no_worker(tmp_path, capsys, no_worker,
                                                             command):
    write_config(tmp_path)
    for nproc in ("nproc=1", "nproc=2"):
        assert echelon3(command, tmp_path, nproc) == 2
        err = capsys.readouterr().err
        assert no_worker == [] and err.count("echelon3: error:") == 1, err
        assert err.strip().splitlines()[-1] == (f"echelon3: error: {target(tmp_path)}: no "
                                                "checkpoint to load (train first)")

"""Checkpoints: atomic writes (interrupted anywhere, even by SIGKILL), safe
loading (torn, foreign and code-carrying files refused by name), fallback on
resume, exit codes, prefix stripping and retention."""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echelon3.checkpoints import files as ckpt
from echelon3.checkpoints.files import CheckpointManager, atomic_save, strip_prefixes
from echelon3.config.errors import CheckpointError, ConfigError, WriteError
from tests.helpers import (assert_same_tensors, echelon3, history, load, make_trainer, target,
                           write_config)

REPO = Path(__file__).resolve().parents[1]
_REAL_SAVE = torch.save


def _state(value: float, size: int = 1000) -> dict:
    return {"model_state_dict": {"w": torch.full((size,), value)}, "epoch": int(value)}


def _bytes_of(obj) -> bytes:
    buffer = io.BytesIO()
    _REAL_SAVE(obj, buffer)
    return buffer.getvalue()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


class Payload:
    """Unpickling this runs ``open(marker, "w")``: code, not data."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _write_payload(path: Path, marker: Path) -> None:
    torch.save({"model_state_dict": {}, "epoch": 99, "global_step": 0,
                "payload": Payload(marker)}, path)


# --------------------------------------------------------------------------- atomic writes


def test_an_uninterrupted_write_replaces_the_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "checkpoint-1.tar"
    atomic_save(_state(1.0), path)
    atomic_save(_state(2.0), path)
    assert load(path)["epoch"] == 2
    assert _leftovers(tmp_path) == []


def _fail(*_args, **_kwargs):
    raise OSError("interrupted")


def _half_then_fail(obj, f, *args, **kwargs):
    data = _bytes_of(obj)
    f.write(data[: len(data) // 2])
    raise OSError("disk full")


@pytest.mark.parametrize("where, patch", [
    ("torch.save writes half, then raises", (torch, "save", _half_then_fail)),
    ("torch.save raises at once", (torch, "save", _fail)),
    ("fsync", (os, "fsync", _fail)),
    ("chmod", (os, "chmod", _fail)),
    ("rename", (os, "replace", _fail)),
])
def test_an_interrupted_write_leaves_the_old_file_intact(tmp_path, monkeypatch, where, patch):
    path = tmp_path / "checkpoint-3.tar"
    atomic_save(_state(1.0), path)
    old = path.read_bytes()
    monkeypatch.setattr(*patch)
    with pytest.raises(WriteError, match="checkpoint-3.tar: cannot write"):
        atomic_save(_state(2.0), path)
    monkeypatch.undo()
    assert path.read_bytes() == old, where
    assert load(path)["epoch"] == 1
    assert _leftovers(tmp_path) == []


def test_an_interrupted_first_write_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", _half_then_fail)
    with pytest.raises(WriteError):
        atomic_save(_state(1.0), tmp_path / "best.tar")
    assert list(tmp_path.iterdir()) == []


KILLED_WRITER = r"""
import io, os, sys, time
import torch
from echelon3.checkpoints import files as checkpoint

stage, path = sys.argv[1], sys.argv[2]
buffer = io.BytesIO()
torch.save({"model_state_dict": {"w": torch.full((300000,), 2.0)}, "epoch": 2}, buffer)
new = buffer.getvalue()


def pause():
    print("ready", flush=True)
    time.sleep(120)


def write(f):
    f.write(new[: len(new) // 2])
    f.flush()
    os.fsync(f.fileno())
    if stage == "writing":
        pause()
    f.write(new[len(new) // 2:])


real_replace = os.replace


def replace(src, dst):
    if stage == "before rename":
        pause()
    real_replace(src, dst)
    if stage == "after rename":
        pause()


os.replace = replace
checkpoint.atomic_write(path, write)
print("finished", flush=True)
"""


def test_a_writer_killed_with_sigkill_leaves_the_old_or_the_new_file(tmp_path):
    """Kill a real writer process at three instants; each file is whole, old or new."""
    stages = {"writing": 1, "before rename": 1, "after rename": 2}  # -> expected epoch
    procs = {}
    for i, stage in enumerate(stages):
        path = tmp_path / str(i) / "checkpoint-1.tar"
        path.parent.mkdir()
        atomic_save(_state(1.0, 300000), path)
        procs[stage] = (path, subprocess.Popen(
            [sys.executable, "-c", KILLED_WRITER, stage, str(path)], cwd=REPO,
            stdout=subprocess.PIPE, text=True))
    for stage, (path, proc) in procs.items():
        try:
            assert proc.stdout.readline().strip() == "ready", stage
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        state = load(path)
        assert state["epoch"] == stages[stage], stage
        assert torch.equal(state["model_state_dict"]["w"],
                           torch.full((300000,), float(stages[stage])))
        # A temp file a killed writer leaves is never taken for a checkpoint.
        assert CheckpointManager(path.parent).rolling() == [path]


# --------------------------------------------------------------------------- safe loading


def test_a_checkpoint_carrying_pickled_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "checkpoint-5.tar"
    _write_payload(path, marker)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(path)
    assert str(path) in str(err.value) and "refused" in str(err.value)
    assert not marker.exists()
    # The file really carries code: an unsafe load would have run it.
    unsafe = tmp_path / "copy.tar"
    shutil.copy(path, unsafe)
    torch.load(unsafe, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("content", [
    b"",
    b"not a checkpoint at all",
    _bytes_of({"weights": torch.ones(3)}),  # a torch file, but not one of ours
    _bytes_of(torch.ones(3)),
])
def test_torn_or_foreign_files_are_refused_by_name(tmp_path, content):
    path = tmp_path / "checkpoint-2.tar"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(path)
    assert str(path) in str(err.value)


def test_a_truncated_checkpoint_is_refused(tmp_path):
    path = tmp_path / "checkpoint-2.tar"
    atomic_save(_state(2.0), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="checkpoint-2.tar"):
        ckpt.load(path)


def test_latest_loadable_falls_back_past_bad_files_naming_them(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, checkpoints_to_keep=5)
    for epoch in (1, 2):
        manager.save_checkpoint(_state(float(epoch)), epoch)
    (tmp_path / "checkpoint-3.tar").write_bytes(b"torn")
    _write_payload(tmp_path / "checkpoint-4.tar", tmp_path / "payload-ran")
    caplog.set_level(logging.WARNING)
    path, state = manager.latest_loadable()
    assert path.name == "checkpoint-2.tar" and state["epoch"] == 2
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "checkpoint-4.tar" in warned and "checkpoint-3.tar" in warned
    assert not (tmp_path / "payload-ran").exists()


def test_latest_loadable_stops_when_none_loads(tmp_path):
    manager = CheckpointManager(tmp_path)
    assert manager.latest_loadable() is None  # nothing there: start fresh
    (tmp_path / "checkpoint-1.tar").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="none loads"):
        manager.latest_loadable()


# --------------------------------------------------------------------------- through the CLI


def _train(folder: Path) -> Path:
    """The same run as ``trained`` in ``folder`` (the config, target.path included, must match
    for a resume)."""
    write_config(folder)
    assert echelon3("train", folder) == 0
    return target(folder)


def _copy_run(trained: Path, folder: Path) -> Path:
    """A copy of the trained run for evaluate/run (they do not compare configs)."""
    shutil.copytree(target(trained), target(folder))
    write_config(folder)
    return target(folder)


def test_train_resumes_past_a_torn_newest_checkpoint_with_a_warning(trained, tmp_path, caplog):
    out = _train(tmp_path)
    newest = out / "checkpoint-2.tar"
    newest.write_bytes(newest.read_bytes()[:1000])
    caplog.set_level(logging.INFO)
    assert echelon3("train", tmp_path) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(newest) in m for m in messages if "skipping" in m)
    assert any("Resuming from" in m and "checkpoint-1.tar" in m for m in messages)
    # Epoch 2 was trained again, and the run matches the one that was never torn.
    assert_same_tensors(load(newest)["model_state_dict"],
                        load(target(trained) / "checkpoint-2.tar")["model_state_dict"])
    assert history(out) == history(target(trained))


def test_train_refuses_a_payload_checkpoint_and_falls_back(tmp_path, caplog):
    out = _train(tmp_path)
    marker = tmp_path / "payload-ran"
    _write_payload(out / "checkpoint-3.tar", marker)
    caplog.set_level(logging.WARNING)
    assert echelon3("train", tmp_path, "trainer.config.epochs=3") == 0
    assert not marker.exists()
    assert any("checkpoint-3.tar" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING)
    assert load(out / "checkpoint-3.tar")["epoch"] == 3  # replaced by a real one


def test_train_stops_with_exit_2_when_no_checkpoint_loads(tmp_path, capsys):
    write_config(tmp_path)
    out = target(tmp_path)
    out.mkdir()
    (out / "checkpoint-1.tar").write_bytes(b"torn")
    (out / "checkpoint-2.tar").write_bytes(b"also torn")
    assert echelon3("train", tmp_path) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "none loads" in err
    assert (out / "checkpoint-1.tar").read_bytes() == b"torn"
    assert (out / "checkpoint-2.tar").read_bytes() == b"also torn"
    assert not (out / "best.tar").exists()


@pytest.mark.parametrize("command", ["evaluate", "run"])
def test_evaluate_and_run_stop_with_exit_2_on_a_bad_checkpoint(trained, tmp_path, capsys,
                                                               command):
    out = _copy_run(trained, tmp_path)
    (out / "best.tar").unlink()
    (out / ".best.tar").unlink()
    torn = out / "checkpoint-2.tar"
    torn.write_bytes(torn.read_bytes()[:500])
    assert echelon3(command, tmp_path) == 2  # the default falls to the newest rolling one
    assert str(torn) in capsys.readouterr().err
    marker = tmp_path / "payload-ran"
    _write_payload(out / "evil.tar", marker)
    section = "evaluator" if command == "evaluate" else "runner"
    assert echelon3(command, tmp_path, f"+{section}.config.checkpoint=evil.tar") == 2
    assert "evil.tar" in capsys.readouterr().err
    assert not marker.exists()
    assert not (out / "metrics.json").exists() and not (out / "predictions.csv").exists()


@pytest.mark.parametrize("command", ["evaluate", "run"])
def test_evaluate_and_run_without_any_checkpoint_exit_2(tmp_path, capsys, command):
    write_config(tmp_path)
    assert echelon3(command, tmp_path) == 2
    assert "train first" in capsys.readouterr().err
    assert echelon3(command, tmp_path, "nproc=2") == 2  # both ranks refuse: said once
    err = capsys.readouterr().err
    assert err.count("echelon3: error:") == 1, err
    assert err.strip().splitlines()[-1].endswith("no checkpoint to load (train first)")


def test_a_checkpoint_holds_the_documented_fields(trained):
    state = load(target(trained) / "checkpoint-2.tar")
    assert {"model_state_dict", "optimizer_state_dict", "scheduler_state_dict",
            "scaler_state_dict", "epoch", "global_step", "metrics", "rng_state"} <= set(state)
    assert state["epoch"] == 2 and state["global_step"] == 12
    assert set(state["metrics"]) == {"loss", "accuracy"}
    assert {"torch", "numpy", "python"} <= set(state["rng_state"])
    assert state["scheduler_state_dict"]["last_epoch"] == 2
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model_state_dict"])
    best = load(target(trained) / "best.tar")
    assert best["metrics"]["accuracy"] == max(r["accuracy"]
                                              for r in history(target(trained), "val"))


# --------------------------------------------------------------------------- prefixes


def test_prefixes_of_wrappers_are_stripped():
    assert strip_prefixes({"module.a.weight": 1, "module.b": 2}) == {"a.weight": 1, "b": 2}
    assert strip_prefixes({"_orig_mod.a": 1}) == {"a": 1}
    assert strip_prefixes({"module._orig_mod.a": 1, "module._orig_mod.b.c": 2}) == {
        "a": 1, "b.c": 2}
    assert strip_prefixes({"encoder._orig_mod.a": 1, "head.b": 2}) == {"encoder.a": 1,
                                                                       "head.b": 2}


def test_a_child_named_module_keeps_its_name():
    net = torch.nn.Module()
    net.module = torch.nn.Linear(2, 2)
    net.head = torch.nn.Linear(2, 2)
    assert strip_prefixes(net.state_dict()).keys() == net.state_dict().keys()


def test_a_compiled_network_state_dict_is_stripped():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    compiled = torch.compile(net)  # lazy: nothing is compiled until the first call
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert_same_tensors(strip_prefixes(compiled.state_dict()), net.state_dict())


def test_the_trainer_saves_an_unwrapped_state_dict_of_a_compiled_network(tmp_path):
    net = torch.nn.Linear(4, 3)
    trainer = make_trainer(tmp_path, net=torch.compile(net), epochs=1)
    assert_same_tensors(trainer.state_dict()["model_state_dict"], net.state_dict())


def test_old_checkpoints_with_wrapper_prefixes_load_for_evaluation(trained, tmp_path):
    out = _copy_run(trained, tmp_path)
    assert echelon3("evaluate", tmp_path) == 0
    plain = (out / "metrics.json").read_text()
    state = load(out / "best.tar")
    state["model_state_dict"] = {f"module._orig_mod.{k}": v
                                 for k, v in state["model_state_dict"].items()}
    for name in ("best.tar", ".best.tar"):
        (out / name).unlink()
    torch.save(state, out / "best.tar")
    (out / "metrics.json").unlink()
    assert echelon3("evaluate", tmp_path) == 0
    assert (out / "metrics.json").read_text() == plain
    assert set(ckpt.load(out / "best.tar")["model_state_dict"]) == set(
        load(target(trained) / "best.tar")["model_state_dict"])


# --------------------------------------------------------------------------- retention and best


def test_retention_keeps_the_newest_n_by_epoch_number(tmp_path):
    manager = CheckpointManager(tmp_path, checkpoints_to_keep=2)
    for epoch in range(1, 12):
        manager.save_checkpoint(_state(float(epoch), 4), epoch)
    assert [p.name for p in manager.rolling()] == ["checkpoint-11.tar", "checkpoint-10.tar"]
    one = CheckpointManager(tmp_path / "one", checkpoints_to_keep=1)
    for epoch in (8, 9, 10):
        one.save_checkpoint(_state(float(epoch), 4), epoch)
    assert [p.name for p in one.rolling()] == ["checkpoint-10.tar"]
    with pytest.raises(ConfigError, match="target.checkpoints_to_keep"):
        CheckpointManager(tmp_path, checkpoints_to_keep=0)


def test_a_run_keeps_checkpoints_to_keep_rolling_files(tmp_path):
    write_config(tmp_path, {"trainer": {"config": {"epochs": 3}},
                            "target": {"checkpoints_to_keep": 1}})
    assert echelon3("train", tmp_path) == 0
    assert sorted(p.name for p in target(tmp_path).glob("checkpoint-*.tar")) == [
        "checkpoint-3.tar"]


def test_best_survives_deletion_of_its_public_name(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save_best(_state(3.0))
    (tmp_path / "best.tar").unlink()
    manager.ensure_best()
    assert load(tmp_path / "best.tar")["epoch"] == 3
    manager.save_best(_state(4.0))
    assert load(tmp_path / "best.tar")["epoch"] == 4


def test_inference_picks_best_then_the_newest_rolling_then_a_named_file(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError):
        manager.for_inference()
    manager.save_checkpoint(_state(9.0, 4), 9)
    manager.save_checkpoint(_state(10.0, 4), 10)
    assert manager.for_inference().name == "checkpoint-10.tar"
    manager.save_best(_state(9.0, 4))
    assert manager.for_inference().name == "best.tar"
    assert manager.for_inference("checkpoint-9.tar") == tmp_path / "checkpoint-9.tar"

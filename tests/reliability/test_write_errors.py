"""Disk full and write errors: one line naming the file and the cause, no traceback, the
previous checkpoint intact, and a rerun once there is space continues to the same weights."""

from __future__ import annotations

import errno
import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from echelon3.observe import loggers as mlops_base
from tests.helpers import assert_same_tensors, echelon3, load, write_config

PROMISE = "disk full / write error: one line, previous checkpoint intact, rerun resumes"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-epoch run on an ordinary disk."""
    folder = tmp_path_factory.mktemp("reference")
    write_config(folder)
    assert echelon3("train", folder) == 0
    return load(folder / "out" / "checkpoint-2.tar")


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted for this test (needs root)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path, leave: int) -> Path:
    """Take all but ``leave`` bytes of the file system with one file."""
    filler = mount / "filler"
    free = shutil.disk_usage(mount).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("echelon3:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".link"))]


def test_a_full_disk_during_a_checkpoint_write(tmp_path, tmpfs, capfd, reference, ledger):
    write_config(tmp_path, {"target": {"path": str(tmpfs / "out")},
                            "trainer": {"config": {"epochs": 1}}})
    out = tmpfs / "out"
    assert echelon3("train", tmp_path) == 0
    first = (out / "checkpoint-1.tar").read_bytes()
    filler = _fill(tmpfs, 16 * 1024)  # room for the small files, not for a checkpoint
    capfd.readouterr()
    assert echelon3("train", tmp_path, "trainer.config.epochs=2") == 2
    line = _one_error_line(capfd.readouterr().err)
    assert line.startswith(f"echelon3: error: {out}/")
    assert line.endswith("cannot write (No space left on device)")
    assert ".best.tar:" in line or "checkpoint-2.tar:" in line
    assert (out / "checkpoint-1.tar").read_bytes() == first
    assert _leftovers(out) == []
    filler.unlink()
    assert echelon3("train", tmp_path, "trainer.config.epochs=2") == 0
    assert_same_tensors(load(out / "checkpoint-2.tar")["model_state_dict"],
                        reference["model_state_dict"])
    ledger(PROMISE, trials=1, faults=1)


def test_a_full_disk_before_config_yaml_is_written(tmp_path, tmpfs, capfd, reference, ledger):
    write_config(tmp_path, {"target": {"path": str(tmpfs / "out")}})
    (tmpfs / "out").mkdir()
    filler = _fill(tmpfs, 0)
    assert echelon3("train", tmp_path) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert line == (f"echelon3: error: {tmpfs / 'out' / 'config.yaml'}: cannot write "
                    "(No space left on device)")
    filler.unlink()
    assert echelon3("train", tmp_path) == 0
    assert_same_tensors(load(tmpfs / "out" / "checkpoint-2.tar")["model_state_dict"],
                        reference["model_state_dict"])
    ledger(PROMISE, trials=1, faults=1)


class _FillsUp(io.StringIO):
    """A history file that takes ``room`` lines, then fails as a full disk does."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room

    def write(self, text: str) -> int:
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= 1
        return super().write(text)


def test_a_full_disk_while_appending_to_history(tmp_path, monkeypatch, capfd, reference, ledger):
    write_config(tmp_path)
    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("history.jsonl") and "a" in mode:
            return _FillsUp(room=4)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(mlops_base, "open", fake_open, raising=False)
    assert echelon3("train", tmp_path) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert line == (f"echelon3: error: {tmp_path / 'out' / 'history.jsonl'}: cannot write "
                    "(No space left on device)")
    monkeypatch.undo()
    assert echelon3("train", tmp_path) == 0
    assert_same_tensors(load(tmp_path / "out" / "checkpoint-2.tar")["model_state_dict"],
                        reference["model_state_dict"])
    ledger(PROMISE, trials=1, faults=1)

"""``target.async_save: true``: checkpoints copied before the save returns, written by one
background thread, one at a time, atomically; waited for at preemption and at the end.

Each test checks against the synchronous write (the same state through the same
manager with ``async_save: false``), bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from echelon3.checkpoints import files
from echelon3.checkpoints.background import BackgroundWriter
from echelon3.checkpoints.files import CheckpointManager
from echelon3.checkpoints.sharded import ShardedCheckpoints
from echelon3.config.errors import ConfigError, WriteError
from tests.conftest import REPO
from tests.helpers import echelon3, load, same_nested, write_config


def _state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A tiny network after one AdamW step, and a checkpoint-like state of it."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    state = {"model_state_dict": net.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
             "epoch": 1, "global_step": 3, "metrics": {"accuracy": 0.5},
             "rng": [torch.get_rng_state()]}
    return net, optimizer, state


def test_an_async_file_loads_equal_to_a_sync_one_and_the_copy_is_taken_first(tmp_path):
    net, optimizer, state = _state()
    sync = CheckpointManager(tmp_path / "sync")
    sync.save_checkpoint(state, 1, best=True)
    manager = CheckpointManager(tmp_path / "async", async_save=True)
    manager.save_checkpoint(state, 1, best=True)
    # training goes on at once: weights and optimizer state change under the write
    net(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    state["metrics"]["accuracy"] = 0.9
    manager.wait()
    written = load(tmp_path / "async/checkpoint-1.tar")
    expected = load(tmp_path / "sync/checkpoint-1.tar")
    assert same_nested(written, expected)
    assert same_nested(load(tmp_path / "async/best.tar"), expected)
    assert os.path.samefile(tmp_path / "async/best.tar", tmp_path / "async/checkpoint-1.tar")
    assert not torch.equal(written["model_state_dict"]["0.weight"], net[0].weight)
    manager.wait()  # nothing in flight: a no-op
    sync.wait()


def test_the_copy_shares_nothing_with_training_and_reuses_its_buffers():
    _, _, state = _state()
    writer = BackgroundWriter()
    first = writer.copy(state)
    second = writer.copy(state)
    weight = state["model_state_dict"]["0.weight"]
    assert first["model_state_dict"]["0.weight"].data_ptr() != weight.data_ptr()
    assert second["model_state_dict"]["0.weight"].data_ptr() == \
        first["model_state_dict"]["0.weight"].data_ptr()  # same shape: the buffer again
    assert same_nested(second, state) and first["metrics"] is not state["metrics"]
    state["model_state_dict"]["0.weight"] = torch.zeros(2, 2)  # another shape: a new buffer
    assert writer.copy(state)["model_state_dict"]["0.weight"].shape == (2, 2)


class _Gate:
    """``atomic_save`` that records when each write starts and ends, and holds the first
    one until released: the writer's progress is observed, not timed."""

    def __init__(self):
        self.events: list[str] = []
        self.started, self.release = threading.Event(), threading.Event()
        self.real = files.atomic_save

    def __call__(self, obj, path):
        self.events.append(f"start {Path(path).name}")
        self.started.set()
        self.release.wait(timeout=60)
        self.real(obj, path)
        self.events.append(f"end {Path(path).name}")


def test_one_save_in_flight_and_preemption_waits_then_writes_at_once(tmp_path, monkeypatch):
    gate = _Gate()
    monkeypatch.setattr(files, "atomic_save", gate)
    _, _, state = _state()
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save_checkpoint(state, 1)  # returns while its write is held
    assert gate.started.wait(timeout=30)
    second = threading.Thread(target=manager.save_checkpoint, args=(state, 2))
    second.start()
    second.join(timeout=0.3)
    assert second.is_alive() and gate.events == ["start checkpoint-1.tar"]  # it waits
    assert manager.rolling() == []  # nothing renamed into place yet
    gate.release.set()
    second.join(timeout=30)
    preempted = manager.save_preempted({**state, "epoch": 2, "global_step": 7})
    # the preemption checkpoint waited for checkpoint-2 and is on disk when it returns
    assert gate.events == ["start checkpoint-1.tar", "end checkpoint-1.tar",
                           "start checkpoint-2.tar", "end checkpoint-2.tar",
                           f"start {preempted.name}", f"end {preempted.name}"]
    assert [p.name for p in manager.rolling()] == ["checkpoint-2-step7.tar", "checkpoint-2.tar",
                                                   "checkpoint-1.tar"]


def test_a_failing_background_write_surfaces_at_wait_naming_the_file(tmp_path, monkeypatch):
    _, _, state = _state()
    manager = CheckpointManager(tmp_path / "run", async_save=True)
    manager.save_checkpoint(state, 1)
    manager.wait()

    def full(obj, f):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(WriteError) as sync_error:
        CheckpointManager(tmp_path / "run").save_checkpoint(state, 2)
    manager.save_checkpoint(state, 2)  # returns: the failure is the thread's
    with pytest.raises(WriteError) as error:
        manager.wait()
    assert str(error.value) == str(sync_error.value)
    assert error.value.key == str(tmp_path / "run/checkpoint-2.tar")
    assert "No space left on device" in str(error.value)
    monkeypatch.undo()
    assert [p.name for p in manager.rolling()] == ["checkpoint-1.tar"]
    manager.wait()  # raised once


def test_async_save_must_be_a_bool_and_the_sharded_manager_carries_it(tmp_path):
    with pytest.raises(ConfigError) as error:
        CheckpointManager(tmp_path, async_save="yes")
    assert error.value.key == "target.async_save"
    for flag in (False, True):
        manager = CheckpointManager(tmp_path, 3, async_save=flag)
        like = ShardedCheckpoints.like(manager, sharded=True)
        assert (like.async_save, like.checkpoints_to_keep, like.path) == (flag, 3, tmp_path)


# --------------------------------------------------------------------------- a kill mid-write

KILLED = textwrap.dedent("""
    import sys, threading, torch
    from pathlib import Path
    from echelon3.checkpoints.files import CheckpointManager

    folder = Path(sys.argv[1])
    state = {"model_state_dict": {"w": torch.arange(300_000.0)}, "epoch": 1}
    manager = CheckpointManager(folder, async_save=True)
    manager.save_checkpoint(state, 1)
    manager.wait()
    real_save = torch.save

    stalled = threading.Event()

    class Stalling:  # the file the second write goes to: it stops after its first bytes
        def __init__(self, f): self.f = f
        def write(self, data):
            n = self.f.write(data)
            if not stalled.is_set():
                self.f.flush()
                stalled.set()
                threading.Event().wait()
            return n
        def __getattr__(self, name): return getattr(self.f, name)

    torch.save = lambda obj, f: real_save(obj, Stalling(f))
    manager.save_checkpoint({**state, "epoch": 2}, 2)
    print("returned", flush=True)  # one thread prints, so the two lines never interleave
    stalled.wait()
    print("temp", *[p.name for p in folder.iterdir() if p.name.endswith(".tmp")], flush=True)
    threading.Event().wait()
""")


def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(folder)], env=env, text=True,
                            stdout=subprocess.PIPE)
    try:
        said = [proc.stdout.readline().split()[:1], proc.stdout.readline().split()[:1]]
        assert said == [["returned"], ["temp"]]  # the save returned; the write is under way
        assert any(p.name.startswith(".checkpoint-2.tar.") for p in folder.iterdir())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.stdout.close()
    manager = CheckpointManager(folder)
    path, state = manager.latest_loadable()
    assert path.name == "checkpoint-1.tar" and state["epoch"] == 1
    assert torch.equal(state["model_state_dict"]["w"], torch.arange(300_000.0))
    removed = manager.remove_leftovers()  # the next start
    assert [p.name.split(".tar.")[0] for p in removed] == [".checkpoint-2"]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-1.tar"]


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[bool, Path]:
    runs = {}
    for flag in (False, True):
        folder = tmp_path_factory.mktemp(f"async-{flag}")
        write_config(folder)
        assert echelon3("train", folder, f"target.async_save={str(flag).lower()}") == 0
        runs[flag] = folder / "out"
    return runs


def test_train_with_async_save_ends_with_the_same_checkpoints(trained):
    names = sorted(p.name for p in trained[False].glob("*.tar"))
    assert names == sorted(p.name for p in trained[True].glob("*.tar")) and \
        "checkpoint-2.tar" in names
    for name in names:
        sync, background = load(trained[False] / name), load(trained[True] / name)
        for key in ("model_state_dict", "optimizer_state_dict", "epoch", "global_step",
                    "metrics", "best_metrics"):
            assert same_nested(sync.get(key), background.get(key)), (name, key)
    assert (trained[True] / "summary.json").is_file()


def test_async_save_may_change_between_attempts_of_a_run(tmp_path):
    from omegaconf import OmegaConf

    from echelon3.tasks.identity import fingerprint

    cfg = OmegaConf.load(write_config(tmp_path))
    toggled = OmegaConf.merge(cfg, {"target": {"async_save": True}})
    assert fingerprint(cfg) == fingerprint(toggled)


def test_a_bad_async_save_value_is_one_line_naming_the_key(tmp_path, capsys):
    write_config(tmp_path)
    assert echelon3("train", tmp_path, "target.async_save=3") == 2
    # the pre-flight reads the keyword's annotation, before any process starts
    assert "target.async_save: expected true or false, got 3" in capsys.readouterr().err


# --------------------------------------------------------------------------- sharded (FSDP)

def _sharded_worker(rank: int, folder: Path) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank,
                            world_size=2)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        for unit in (net[0], net[2], net):
            fully_shard(unit)
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
        torch.manual_seed(rank)
        net(torch.randn(5, 4)).sum().backward()
        optimizer.step()

        def state():
            return {"model_state_dict": net.state_dict(), "epoch": 1, "global_step": 1,
                    "metrics": {"accuracy": 0.5}}

        sync = ShardedCheckpoints(folder / "sync")
        sync.attach(net, optimizer)
        sync.save_checkpoint(state(), 1, best=True)
        manager = ShardedCheckpoints(folder / "async", async_save=True)
        manager.attach(net, optimizer)
        manager.save_checkpoint(state(), 1, best=True)
        in_place_before_wait = (folder / "async/checkpoint-1.dcp").exists()
        # training goes on (its collectives on the default group) while the shards are written
        net(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        with torch.no_grad():
            for param in net.parameters():
                param.add_(1.0)
        manager.wait()
        (folder / f"rank{rank}.json").write_text(json.dumps(in_place_before_wait))
    finally:
        dist.destroy_process_group()


def test_sharded_async_folder_loads_equal_to_the_sync_one(tmp_path):
    import json

    import torch.multiprocessing as mp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    mp.spawn(_sharded_worker, args=(tmp_path,), nprocs=2, join=True)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == \
        [False, False]  # renamed into place only at wait(), once both ranks had written
    whole = {}
    for kind in ("sync", "async"):
        folder = tmp_path / kind / "checkpoint-1.dcp"
        dcp_to_torch_save(folder, tmp_path / f"{kind}.pt")
        whole[kind] = (load(tmp_path / f"{kind}.pt"), load(folder / "state.pt"),
                       load(tmp_path / kind / "best.tar"))
        assert sorted(p.name for p in (tmp_path / kind).iterdir()) == \
            [".best.tar", "best.tar", "checkpoint-1.dcp"]
    assert whole["sync"][0]["optimizer_state_dict"]["state"]  # AdamW's moments are in
    for sync, background in zip(whole["sync"], whole["async"]):
        assert same_nested(sync, background)


def test_a_run_stopped_by_ctrl_c_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    """The write of checkpoint-1 is held until someone waits for it; Ctrl-C at the start of
    epoch 2 then returns only once it is on disk (else the folder would be taken back as a
    run that never reached its first checkpoint)."""
    from echelon3.trainers.baseline import Trainer

    gate = _Gate()
    monkeypatch.setattr(files, "atomic_save", gate)
    real_wait, real_epoch = BackgroundWriter.wait, Trainer._train_epoch

    def wait(self):
        if self._thread is not None:  # only a wait for a write in flight lets it go on
            gate.release.set()
        real_wait(self)

    def epoch(self, index, clock):
        if index == 1:
            raise KeyboardInterrupt
        return real_epoch(self, index, clock)

    monkeypatch.setattr(BackgroundWriter, "wait", wait)
    monkeypatch.setattr(Trainer, "_train_epoch", epoch)
    write_config(tmp_path)
    assert echelon3("train", tmp_path, "target.async_save=true") == 130
    assert "end checkpoint-1.tar" in gate.events
    assert load(tmp_path / "out/checkpoint-1.tar")["epoch"] == 1


# --------------------------------------------------------------------------- the benchmark

def test_the_benchmark_measures_both_modes_at_1_and_2_ranks_in_its_quick_mode(capsys):
    from benchmarks import async_save

    assert async_save.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or
            line.startswith("| 2 |")]
    assert len(rows) == 8  # printed as measured, then in the table
    assert {(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in rows} == {
        (n, f"`async_save: {flag}`") for n in ("1", "2") for flag in ("false", "true")}


def test_the_page_shows_the_benchmarks_table_between_its_markers():
    import re

    from benchmarks import async_save

    page = async_save.PAGE.read_text()
    region = page.split(async_save.START, 1)[1].split(async_save.END, 1)[0].strip().splitlines()
    assert region[0] == "| ranks | save | training blocked per save | until the file is complete |"
    assert [line.split("|")[1:3] for line in region[2:6]] == [
        [f" {n} ", f" `async_save: {flag}` "] for n in (1, 2) for flag in ("false", "true")]
    assert re.fullmatch(r"Measured \d{4}-\d{2}-\d{2} on \d+ CPU cores \(load average [\d.]+ at "
                        r"the start, [\d.]+ at the end\), torch \S+: 10\d\.\d M parameters .*",
                        region[-1])


@pytest.mark.gpu
def test_gpu_tensors_are_copied_into_pinned_buffers_reused_between_saves(tmp_path):
    _, _, state = _state()
    on_gpu = {"model_state_dict": {k: v.cuda() for k, v in state["model_state_dict"].items()},
              "epoch": 1}
    writer = BackgroundWriter()
    first = writer.copy(on_gpu)
    again = writer.copy(on_gpu)
    for name, tensor in on_gpu["model_state_dict"].items():
        copied = again["model_state_dict"][name]
        assert copied.device.type == "cpu" and copied.is_pinned()
        assert copied.data_ptr() == first["model_state_dict"][name].data_ptr()
        assert torch.equal(copied, tensor.cpu())
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save_checkpoint(on_gpu, 1)
    for tensor in on_gpu["model_state_dict"].values():
        tensor.add_(1.0)  # on the GPU, right after the save returned
    manager.wait()
    assert same_nested(load(tmp_path / "checkpoint-1.tar")["model_state_dict"],
                       state["model_state_dict"])

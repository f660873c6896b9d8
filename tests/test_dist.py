"""DDP for real: 2 gloo ranks on the CPU, through the built-in launcher (nproc=2) and torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from echelon3.distributed import launch as dist
from echelon3.distributed import ranks
from tests.conftest import BIN, echelon3_cmd, edit_yaml, run_cli

TORCHRUN = shutil.which("torchrun", path=str(BIN)) or shutil.which("torchrun")


def launch(mode: str, config_dir: Path, *overrides: str, task: str = "train", timeout=240):
    """Run ``echelon3 <task>`` on 2 ranks: mode 'builtin' (nproc=2) or 'torchrun'."""
    args = [task, "-cd", str(config_dir), "-cn", "probe", *overrides]
    if mode == "builtin":
        return run_cli([*args, "nproc=2"], timeout=timeout)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", echelon3_cmd()[0], *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, env=env)


def read_probe(config_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for path in sorted((config_dir / "probe").glob("rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out[rows[0]["rank"]] = rows
    return out


def history(config_dir: Path) -> list[dict]:
    path = config_dir / "run" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


MODES = ["builtin", "torchrun"]


# --------------------------------------------------------------------------- batches and order

@pytest.mark.parametrize("mode", MODES)
def test_global_batch_is_split_and_order_differs_per_rank_and_epoch(probe, mode):
    config_dir, write = probe
    write(train_size=64, batch=8, epochs=2)
    result = launch(mode, config_dir)
    assert result.returncode == 0, result.stderr
    seen = read_probe(config_dir)
    assert sorted(seen) == [0, 1]
    steps_per_epoch = 64 // 8  # global: 4 samples per rank per step, 8 steps per epoch
    for rank, rows in seen.items():
        assert {r["world"] for r in rows} == {2}
        assert all(len(r["batch"]) == 4 for r in rows), "each rank must get batch = 8 / 2"
        assert len(rows) == 2 * steps_per_epoch
    epoch = {(rank, e): [i for r in rows[e * steps_per_epoch:(e + 1) * steps_per_epoch]
                         for i in r["batch"]] for rank, rows in seen.items() for e in (0, 1)}
    for e in (0, 1):  # the ranks split each epoch's data between them
        assert not set(epoch[0, e]) & set(epoch[1, e])
        assert sorted(epoch[0, e] + epoch[1, e]) == list(range(64))
    assert epoch[0, 0] != epoch[0, 1] and epoch[1, 0] != epoch[1, 1]  # set_epoch reshuffles


@pytest.mark.parametrize("mode", MODES)
def test_indivisible_batch_fails_fast_with_the_value_error(probe, mode):
    config_dir, write = probe
    write(batch=9)
    start = time.monotonic()
    result = launch(mode, config_dir, timeout=120)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "batch_size 9 is global and must be divisible by the world size 2" in text
    assert "use 8 or 10" in text
    assert time.monotonic() - start < 60
    if mode == "builtin":  # checked before any worker starts: one line, exit 2
        assert result.returncode == 2
        assert "Traceback" not in text
        assert not (config_dir / "probe" / "rank0.jsonl").exists()


def test_batch_size_error_is_a_value_error():
    from echelon3.data.loaders import per_rank_batch

    with pytest.raises(ValueError, match="dataloaders.train.config.batch_size"):
        per_rank_batch(30, 4, "dataloaders.train.config.batch_size")
    assert per_rank_batch(40, 4, "k") == 10


# --------------------------------------------------------------------------- validation metrics

@pytest.mark.parametrize("mode", MODES)
def test_sharded_validation_equals_single_process_exactly(probe, mode):
    config_dir, write = probe
    metrics = [
        {"accuracy": {"module": "torchmetrics.classification", "type": "MulticlassAccuracy",
                      "config": {"num_classes": 2, "average": "micro"}}},
        {"counted": {"module": "tests/probe.py", "type": "CountingAccuracy"}},
        {"seen": {"module": "tests/probe.py", "type": "SeenSamples"}},
        {"shard_only": {"module": "tests/probe.py", "type": "ShardOnlySeen"}},
    ]
    for m in metrics:
        spec = next(iter(m.values()))
        if spec["module"].startswith("tests/"):
            spec["module"] = str(Path(__file__).parent / "probe.py")
    write(test_size=101, epochs=1, metrics=metrics)
    result = launch(mode, config_dir)
    assert result.returncode == 0, result.stderr
    val = [r for r in history(config_dir) if r["split"] == "val"][-1]
    assert val["seen"] == 101.0  # no sample counted twice, none dropped
    assert val["shard_only"] == 51.0  # without dist_reduce a metric sees rank 0's shard only

    single_out = config_dir / "single.json"
    one = run_cli(["evaluate", "-cd", str(config_dir), "-cn", "probe",
                   f"+evaluator.output={single_out}"])
    assert one.returncode == 0, one.stderr
    single = json.loads(single_out.read_text())
    assert single["seen"] == 101.0 and single["shard_only"] == 101.0
    for name in ("accuracy", "counted", "loss"):
        assert val[name] == pytest.approx(single[name], abs=1e-6), name
    assert val["accuracy"] == pytest.approx(val["counted"], abs=1e-6)

    two_out = config_dir / "two.json"
    two = launch(mode, config_dir, f"+evaluator.output={two_out}", task="evaluate")
    assert two.returncode == 0, two.stderr
    sharded = json.loads(two_out.read_text())
    for name in ("accuracy", "counted", "seen"):
        assert sharded[name] == single[name], name


# --------------------------------------------------------------------------- rank 0 only

def test_only_rank0_logs_prints_and_writes(probe):
    config_dir, write = probe
    write(epochs=2)
    result = launch("builtin", config_dir)
    assert result.returncode == 0, result.stderr
    summaries = [line for line in result.stderr.splitlines() if "epoch 1 step" in line]
    assert len(summaries) == 1, result.stderr
    assert result.stderr.count("training on cpu x2") == 1
    records = history(config_dir)
    assert len([r for r in records if r["split"] == "val"]) == 2
    files = sorted(p.name for p in (config_dir / "run").iterdir())
    assert "checkpoint-1.tar" in files and "checkpoint-2.tar" in files and "best.tar" in files
    assert not [f for f in files if f.endswith(".tmp")]


def test_save_checkpoint_returns_at_once_off_rank0(tmp_path, monkeypatch):
    from echelon3.checkpoints.files import CheckpointManager

    manager = CheckpointManager(tmp_path / "run", 2)
    monkeypatch.setenv("RANK", "1")
    manager.save_checkpoint({"model_state_dict": {}}, 1)
    manager.save_best({"model_state_dict": {}})
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("RANK", "0")
    manager.save_checkpoint({"model_state_dict": {}}, 1)
    assert (tmp_path / "run" / "checkpoint-1.tar").exists()


@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_cross_resume_between_one_and_two_processes(probe, mode):
    config_dir, write = probe
    write(epochs=1)
    first = launch(mode, config_dir)
    assert first.returncode == 0, first.stderr
    state = torch.load(config_dir / "run" / "checkpoint-1.tar", weights_only=True)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model_state_dict"])

    second = run_cli(["train", "-cd", str(config_dir), "-cn", "probe", "trainer.config.epochs=2"])
    assert second.returncode == 0, second.stderr
    assert "Resuming from" in second.stderr and "checkpoint-1.tar" in second.stderr
    assert (config_dir / "run" / "checkpoint-2.tar").exists()

    third = launch(mode, config_dir, "trainer.config.epochs=3")
    assert third.returncode == 0, third.stderr
    assert "Resuming from" in third.stderr + third.stdout
    final = torch.load(config_dir / "run" / "checkpoint-3.tar", weights_only=True)
    assert final["epoch"] == 3 and final["global_step"] == 3 * 8


@pytest.mark.parametrize("mode", MODES)
def test_two_rank_resume_equals_an_uninterrupted_run(tmp_path, mode):
    """Every rank gets its own RNG state back (dropout differs per rank), so 2+2 == 4."""
    from tests.conftest import probe_config

    runs = {}
    for name, plan in (("straight", [4]), ("resumed", [2, 4])):
        directory = tmp_path / name
        probe_config(directory, epochs=4, net={"dropout": 0.5})
        for epochs in plan:
            result = launch(mode, directory, f"trainer.config.epochs={epochs}")
            assert result.returncode == 0, result.stderr
        runs[name] = torch.load(directory / "run" / "checkpoint-4.tar", weights_only=True)
        assert len(runs[name]["rng_states"]) == 2
    a, b = runs["straight"]["model_state_dict"], runs["resumed"]["model_state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    ranks = runs["straight"]["rng_states"]
    assert not torch.equal(ranks[0]["torch"], ranks[1]["torch"])  # ranks draw differently


# --------------------------------------------------------------------------- failures and Ctrl-C

def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("mode,workers", [("builtin", 0), ("builtin", 1), ("torchrun", 1)])
def test_ctrl_c_exits_130_and_leaves_no_process(probe, mode, workers):
    config_dir, write = probe
    write(epochs=1000, net={"sleep": 0.05})
    edit_yaml(config_dir / "probe.yaml", lambda c: c["dataloaders"]["train"]["config"].update(
        num_workers=workers))
    args = ["train", "-cd", str(config_dir), "-cn", "probe"]
    cmd = [*echelon3_cmd(), *args, "nproc=2"] if mode == "builtin" else [
        TORCHRUN, "--standalone", "--nproc_per_node=2", echelon3_cmd()[0], *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert _wait_for(lambda: (config_dir / "probe" / "rank1.jsonl").exists(), 90), \
            "training never started"
        assert _wait_for(lambda: len(_descendants(proc.pid) | set(_session_pids(proc.pid)))
                         >= 2 + 2 * workers, 30)  # 2 ranks (+ 1 loader worker each)
        run = _descendants(proc.pid) | set(_session_pids(proc.pid)) | {proc.pid}
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert err.count("echelon3: interrupted") == 1, err  # one notice, from rank 0
    assert _wait_for(lambda: not _alive(run), 15), _alive(run)
    assert not _alive(_session_pids(proc.pid))
    if mode == "builtin":
        assert proc.returncode == 130, err
        assert "Traceback" not in err
    else:  # torchrun reports the signal its own way; the workers stopped cleanly
        assert proc.returncode != 0
        assert "echelon3/" not in err.split("echelon3: interrupted")[0].split("Traceback")[-1]


@pytest.mark.parametrize("mode", MODES)
def test_exception_on_rank1_is_reported_and_fails_fast(probe, mode):
    config_dir, write = probe
    write(epochs=50, net={"fail_on_rank": 1, "fail_at_step": 3})
    start = time.monotonic()
    result = launch(mode, config_dir, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "RuntimeError: planted failure on rank 1" in text
    assert "Traceback" in text and "forward" in text  # the rank's own traceback
    assert elapsed < 60, f"took {elapsed:.0f}s: ranks waited on each other"
    named = "echelon3: error: net: RuntimeError: planted failure on rank 1 (during training)"
    assert named in result.stderr.splitlines()
    if mode == "builtin":  # the launcher's last word
        assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == named


def test_the_same_error_on_both_ranks_prints_one_traceback_and_one_line(probe):
    """A metric that cannot take the network's output fails on every rank during the
    first validation: one traceback (the first rank's), then the line naming its key."""
    config_dir, write = probe
    write(epochs=1, metrics=[{"auroc": {"module": "torchmetrics.classification",
                                        "type": "BinaryAUROC"}}])
    result = launch("builtin", config_dir)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert sum("Traceback (most recent call last)" in line for line in lines) == 1, \
        result.stderr
    named = [line for line in lines if line.startswith("echelon3: error: ")]
    assert len(named) == 1 and named == lines[-1:], result.stderr
    assert named[0].startswith("echelon3: error: metrics.auroc: ") and \
        named[0].endswith("(during validation)"), named


def test_rank_killed_by_sigkill_gets_the_oom_hint(probe):
    config_dir, write = probe
    write(epochs=50, net={"fail_on_rank": 1, "fail_at_step": 3, "kill": True})
    start = time.monotonic()
    result = launch("builtin", config_dir, timeout=120)
    assert result.returncode == 1
    assert "OOM-killer" in result.stderr and "num_workers" in result.stderr, result.stderr
    assert time.monotonic() - start < 60


def test_killed_loader_worker_fails_fast_with_hint(probe):
    config_dir, write = probe
    write(epochs=3)

    def change(cfg):
        cfg["dataloaders"]["train"]["config"]["num_workers"] = 1
        cfg["data"]["train"]["config"]["kill_at"] = 5

    edit_yaml(config_dir / "probe.yaml", change)
    start = time.monotonic()
    result = run_cli(["train", "-cd", str(config_dir), "-cn", "probe"], timeout=120)
    assert result.returncode == 1
    assert "killed" in result.stderr and "num_workers" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 60


def test_loader_workers_die_with_their_process(probe):
    config_dir, write = probe
    write(epochs=1000, net={"sleep": 0.05})
    edit_yaml(config_dir / "probe.yaml", lambda c: c["dataloaders"]["train"]["config"].update(
        num_workers=2, persistent_workers=True))
    proc = subprocess.Popen([*echelon3_cmd(), "train", "-cd", str(config_dir), "-cn", "probe"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert _wait_for(lambda: len(_session_pids(proc.pid)) >= 3, 90)
        workers = [p for p in _session_pids(proc.pid) if p != proc.pid]
        os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up
        proc.wait(timeout=10)
        assert _wait_for(lambda: not _alive(workers), 10), \
            "loader workers outlived their process"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_startup_prints_the_batch_prefetch_total(probe):
    config_dir, write = probe
    write(epochs=1)
    edit_yaml(config_dir / "probe.yaml", lambda c: c["dataloaders"]["train"]["config"].update(
        num_workers=2, prefetch_factor=3))
    result = launch("builtin", config_dir)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "in flight" in line]
    assert len(lines) == 1, result.stderr  # rank 0 only
    # 2 ranks x 2 workers x prefetch 3 = 12 batches of 4 samples of 8 float32 + 1 int64
    assert "2 ranks x 2 workers x prefetch 3 = 12 batches of 4" in lines[0]
    assert "MiB of host RAM" in lines[0]


# --------------------------------------------------------------------------- detection

def test_detects_torchrun_first():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
    got = dist.detect_launcher(env)
    assert (got.kind, got.rank, got.local_rank, got.world_size, got.master_addr,
            got.master_port) == ("torchrun", 3, 1, 4, "n1", 29500)


def test_detects_slurm_srun_task():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    got = dist.detect_launcher(env)
    assert (got.kind, got.rank, got.local_rank, got.world_size, got.local_world_size) == (
        "slurm", 5, 1, 8, 4)
    assert got.master_addr == "gpu07"
    assert got.master_port == 15000 + 4242 % 20000


def test_single_task_slurm_job_is_not_a_worker():
    assert dist.detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).kind == "none"
    assert dist.detect_launcher({}).kind == "none"


@pytest.mark.parametrize("nodelist,first", [
    ("node01", "node01"), ("node[01-04]", "node01"), ("a[3,5-7],b1", "a3"), ("x1,x2", "x1")])
def test_first_host_of_a_node_list(nodelist, first, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # the fallback parser, no scontrol
    assert dist.first_host(nodelist) == first


def test_slurm_tasks_form_a_real_process_group(probe):
    """Two processes with only SLURM_* variables (as srun sets them) train together."""
    config_dir, write = probe
    write(train_size=64, batch=8, epochs=1)
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                   SLURM_NNODES="1", SLURM_JOB_ID=str(os.getpid() % 20000),
                   SLURM_JOB_NODELIST="localhost")
        procs.append(subprocess.Popen([*echelon3_cmd(), "train", "-cd", str(config_dir), "-cn",
                                       "probe"], env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = read_probe(config_dir)
    assert sorted(seen) == [0, 1] and all(len(r["batch"]) == 4 for r in seen[1])
    assert "x2" in outs[0][1]


def test_rank_helpers_are_no_ops_in_one_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    t = torch.ones(3)
    ranks.all_reduce_sum_(t)
    assert torch.equal(t, torch.ones(3))
    assert ranks.get_rank() == 0 and ranks.get_world_size() == 1 and ranks.is_main()
    ranks.barrier()
    assert ranks.all_gather_object({"a": 1}) == [{"a": 1}]


def test_process_group_timeout_env(monkeypatch):
    monkeypatch.setenv("ECHELON3_DDP_TIMEOUT_MIN", "0.5")
    assert dist.timeout().total_seconds() == 30
    monkeypatch.delenv("ECHELON3_DDP_TIMEOUT_MIN")
    assert dist.timeout().total_seconds() == 30 * 60


# --------------------------------------------------------------------------- device plan

def _plan(**cfg):
    from omegaconf import OmegaConf

    from echelon3.distributed.runtime import plan_devices

    return plan_devices(OmegaConf.create(cfg))


def test_plan_on_a_cpu_machine(monkeypatch, caplog):
    import logging

    from echelon3.config.errors import ConfigError

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _plan().spawn == 1 and _plan().device_type == "cpu"
    assert (_plan(device="cpu", nproc=3).spawn, _plan(device="cpu", nproc=3).world_size) == (3, 3)
    with pytest.raises(ConfigError, match=r"^gpus: GPU 0 does not exist"):
        _plan(gpus=[0])
    with pytest.raises(ConfigError, match=r"^nproc: must be a positive integer"):
        _plan(device="cpu", nproc=0)
    with pytest.raises(ConfigError, match=r"^device: cuda requested"):
        _plan(device="cuda")
    with caplog.at_level(logging.WARNING):
        _plan(device="cpu", device_ids=[0, 1])
    assert "device_ids is ignored" in caplog.text and "gpus" in caplog.text


def test_plan_on_a_gpu_node(monkeypatch):
    from echelon3.config.errors import ConfigError

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    everything = _plan()
    assert (everything.device_type, everything.gpus, everything.spawn) == ("cuda", [0, 1, 2, 3], 4)
    two = _plan(gpus=[2, 3])
    assert (two.gpus, two.spawn, two.world_size) == ([2, 3], 2, 2)
    assert _plan(gpus=[1]).spawn == 1  # one GPU: in-process, pinned to it
    assert _plan(device="cpu").device_type == "cpu"
    with pytest.raises(ConfigError, match=r"^gpus: GPU 4 does not exist \(visible GPUs: 0-3\)"):
        _plan(gpus=[0, 4])
    with pytest.raises(ConfigError, match=r"^gpus: lists a GPU twice"):
        _plan(gpus=[1, 1])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    worker = _plan(gpus=[0, 1])
    assert (worker.spawn, worker.world_size) == (1, 2)  # torchrun already spawned us

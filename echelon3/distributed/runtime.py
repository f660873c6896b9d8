"""Where a task runs: device plan, spawning, and each worker's set-up and tear-down.

The CLI process validates what it can, decides the plan (CPU / GPUs, how many
processes), and either runs the task in-process or spawns one worker per
device through :func:`echelon3.distributed.launch.spawn`. Each worker (or the single
process) joins the process group, silences itself unless it is rank 0, runs
the task and always leaves the process group.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from echelon3.config.compose import RunConfig
from echelon3.config.derived import derive
from echelon3.config.errors import ConfigError, UserError, blamed
from echelon3.distributed import interrupt
from echelon3.distributed import launch as dist
from echelon3.distributed import preemption, reports
from echelon3.distributed.ranks import is_main

log = logging.getLogger("echelon3")

_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Plan:
    """What the launching process decided; handed to every worker."""

    device_type: str  # "cpu" | "cuda"
    gpus: list[int] = field(default_factory=list)
    spawn: int = 1  # workers to start here; 1 = run in-process
    world_size: int = 1


class RankFilter(logging.Filter):
    """Rank 0 logs everything; other ranks only errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_main() or record.levelno >= logging.ERROR


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now (tests and callers may swap it)."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)


def configure_logging() -> None:
    import tqdm

    tqdm.tqdm.monitor_interval = 0  # no monitor thread: nothing left to trip over at exit
    root = logging.getLogger()
    if any(getattr(h, "_echelon3", False) for h in root.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[echelon3] %(message)s"))
    handler.addFilter(RankFilter())
    handler._echelon3 = True
    root.addHandler(handler)
    logging.getLogger("echelon3").setLevel(logging.INFO)


def _gpu_list(value, count: int) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value or not all(
            isinstance(g, int) and not isinstance(g, bool) for g in value):
        raise ConfigError("gpus", f"must be a non-empty list of GPU indices, got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError("gpus", f"lists a GPU twice: {value}")
    for g in value:
        if not 0 <= g < count:
            visible = f"0-{count - 1}" if count > 1 else ("0" if count == 1 else "none")
            raise ConfigError("gpus", f"GPU {g} does not exist (visible GPUs: {visible})")
    return value


def plan_devices(cfg) -> Plan:
    """Decide device and process count from ``device``, ``gpus``, ``nproc`` and the launcher."""
    import torch

    if cfg.get("device_ids") is not None:
        log.warning("device_ids is ignored (DataParallel was removed); use gpus: [...] to "
                    "select GPUs")
    device = str(cfg.get("device") or "auto").lower()
    if device not in _DEVICES:
        raise ConfigError("device", f"must be one of {', '.join(_DEVICES)}, got {device!r}")
    gpus = OmegaConf.to_container(cfg.gpus) if OmegaConf.is_list(cfg.get("gpus")) \
        else cfg.get("gpus")
    nproc = cfg.get("nproc")
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise ConfigError("nproc", f"must be a positive integer, got {nproc!r}")
    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not cuda:
        raise ConfigError("device", "cuda requested but no GPU is visible")
    launcher = dist.detect_launcher()
    if launcher.kind != "none":
        # Already one worker of a job (torchrun / srun): never spawn again.
        return Plan("cuda" if cuda else "cpu", [], 1, launcher.world_size)
    if not cuda:
        if gpus is not None and device != "cpu":
            _gpu_list(gpus, 0)  # names the missing GPU
        elif gpus is not None:
            log.warning("gpus is ignored with device: cpu; remove it, or drop device: cpu")
        return Plan("cpu", [], nproc or 1, nproc or 1)
    if nproc is not None:
        log.warning("nproc applies to device: cpu; on GPUs use gpus: [...]")
    gpus = _gpu_list(gpus, torch.cuda.device_count()) if gpus is not None \
        else list(range(torch.cuda.device_count()))
    return Plan("cuda", gpus, len(gpus), len(gpus))


def worker_device(plan: Plan, launcher: dist.Launcher):
    import torch

    if plan.device_type == "cpu":
        return torch.device("cpu")
    if plan.gpus:
        index = plan.gpus[launcher.local_rank if launcher.kind != "none" else 0]
    else:  # started by torchrun / srun: the local rank picks among the visible GPUs
        index = launcher.local_rank % max(1, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _silence_non_main(rank: int) -> None:
    if rank == 0:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = open(os.devnull, "w")


Task = Callable[[RunConfig, object, dist.Launcher], None]

raise_if_interrupted = interrupt.raise_if_interrupted  # the training loop's check


def _loader_worker_died(e: BaseException) -> bool:
    """A loader worker killed mid-run surfaces as torch's RuntimeError, or, when it dies
    while sending a batch, as a broken connection inside the loader's queue."""
    if isinstance(e, RuntimeError):
        return "DataLoader worker" in str(e)
    tb = e.__traceback__
    while tb is not None:
        if "torch/utils/data" in tb.tb_frame.f_code.co_filename.replace(os.sep, "/"):
            return True
        tb = tb.tb_next
    return False


def run_worker(task: Task, rc: RunConfig, plan: Plan) -> None:
    """Set up this process as one rank (or the only one), run ``task``, tear down."""
    configure_logging()
    interrupt.install(unblock=dist.relayed_signals())
    launcher = dist.detect_launcher()
    _silence_non_main(launcher.rank)
    device = worker_device(plan, launcher)
    dist.setup_process_group(launcher, "nccl" if device.type == "cuda" else "gloo")
    try:
        if launcher.world_size > 1:
            log.info("ranks: %s", ", ".join(f"{r} on {host}" for r, (host, _)
                                            in enumerate(dist.share_hosts())))
        task(rc, device, launcher)
    except (RuntimeError, ConnectionError, EOFError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        if _loader_worker_died(e):
            raise dist.WorkerFailed(f"a DataLoader worker died ({detail}); {dist.OOM_HINT}",
                                    1) from e
        lost = dist.lost_peer(e)
        if lost:
            # under echelon3's launcher the lost rank is a local one, which it names
            raise dist.WorkerFailed(f"lost {lost}: its process or node is gone; stopping "
                                    f"now, resume from the last checkpoint ({detail})",
                                    dist.PEER_LOST_EXIT if reports.shared() else 1) from e
        raise
    finally:
        dist.teardown_process_group()


def spawned_worker(task: Task, cfg: dict, config_dir: str, config_file: str, plan: Plan) -> None:
    """Entry point of a worker spawned by echelon3; reports errors itself, then exits."""
    dist.own_session()
    rc = RunConfig(OmegaConf.create(cfg), Path(config_dir), Path(config_file))
    with interrupt.handling(keep=True):
        try:
            code = _worker_exit_code(task, rc, plan)
        except KeyboardInterrupt:
            interrupt.disarm()
            code = 130
    sys.exit(code)


def _worker_exit_code(task: Task, rc: RunConfig, plan: Plan) -> int:
    rank = os.environ.get("RANK", "?")
    try:
        run_worker(task, rc, plan)
        return 0
    except preemption.Preempted:
        preemption.before_exit()
        return preemption.RESUBMIT_EXIT
    except Exception as e:
        if interrupt.interrupted():  # a library that swallowed the KeyboardInterrupt failed on
            return 130
        return _reported(e, rank)


def _reported(e: Exception, rank: str) -> int:
    """Say why this worker failed -> its exit code. A user error is one line; an exception
    is its traceback, printed by the first rank it happened to (:mod:`echelon3.distributed.reports`),
    then the line naming the config key whose component raised it. Under echelon3's own
    launcher the lines go to the launcher, which says each once, last."""
    if isinstance(e, UserError):
        if not reports.report(rank, f"error: {e}", 2):
            print(f"echelon3: error: {e}", file=sys.stderr, flush=True)
        return 2
    if isinstance(e, dist.WorkerFailed):
        print(f"echelon3: [rank {rank}] {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if dist.peer_lost(e):  # the rank that failed has said why; no second story here
        if not reports.shared():
            print(f"echelon3: [rank {rank}] {dist.PEER_LOST}", file=sys.stderr, flush=True)
        return dist.PEER_LOST_EXIT
    named = blamed(e)
    # the same failure on every rank: one traceback (its numbers may differ per shard)
    same = named.split(": ", 2)[:2] if named else [type(e).__qualname__, str(e)]
    if reports.first_to_print(" ".join(same)):
        print(f"[rank {rank}] " + "".join(traceback.format_exception(e)).rstrip(),
              file=sys.stderr, flush=True)
    if named is not None and not reports.report(rank, f"error: {named}", 1):
        print(f"echelon3: error: {named}", file=sys.stderr, flush=True)
    return 1


def launch(task: Task, rc: RunConfig, validate: Callable[[Plan], bool | None] | None = None
           ) -> None:
    """Plan, validate before anything starts, then run in-process or spawn workers.
    ``validate`` returning True settled the task itself (a finished run): nothing runs."""
    configure_logging()
    plan = plan_devices(rc.cfg)
    derive(rc.cfg, plan.world_size)  # ${calc:...} over world_size and the config, once here
    if plan.spawn <= 1:
        if validate is None or not validate(plan):
            run_worker(task, rc, plan)
        return
    # As torchrun does: keep N workers from each starting a thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.spawn)))
    with dist.launching([task.__module__, *sys.modules, *_named_modules(rc.cfg)]):
        if validate is not None and validate(plan):
            return
        log.info("starting %d workers (%s)", plan.spawn,
                 f"GPUs {plan.gpus}" if plan.gpus else "CPU, gloo")
        cfg = OmegaConf.to_container(rc.cfg, resolve=True)
        dist.spawn(spawned_worker, (task, cfg, str(rc.config_dir), str(rc.config_file), plan),
                   plan.spawn)


def _named_modules(cfg) -> list[str]:
    """The ``module`` of every component the config names (the server imports echelon3's)."""
    from echelon3.config.build import iter_specs

    return [spec["module"] for _, spec in iter_specs(OmegaConf.to_container(cfg), "")
            if isinstance(spec["module"], str)]

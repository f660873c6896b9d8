"""Where an epoch's time went, and the one lever to pull when the answer is clear.

The trainer hands the train loader through :meth:`EpochClock.batches` (which
times each wait for a batch), marks each step's start and end, and wraps
validation and checkpointing in :meth:`EpochClock.aside`. At the end of each
epoch :meth:`EpochClock.report` returns the fractions of the epoch's wall time:

- ``data_wait``    blocked in ``next(loader)``;
- ``train_step``   forward, backward and optimizer step, as the host sees them
                   (on a GPU: the time to launch them, plus any wait for the device);
- ``overhead``     the rest of the loop: loss bookkeeping, logging, progress bar,
                   scheduler;
- ``validation_checkpoint``  validation, keep-best and the checkpoint.

They sum to 1; ``epoch_s`` is the epoch's wall time, ``cpu_s`` the CPU time
this process used in it (all threads; on a shared machine the steadier measure) and
``batch_ms`` the host's time per micro-batch in ``train_step`` (the train records'
``step_ms`` is the wall time per optimizer step: :mod:`echelon3.trainers.throughput`).
With torch.compile it adds ``compiles``: graphs compiled during the epoch; after
the first epoch (warm-up) any is a recompile, and is warned about. On a GPU it
adds ``device_batch_ms`` (CUDA events around one micro-batch per log interval, read
without waiting) and ``device_util`` (NVML's utilization, when pynvml is
installed). The cost is four clock reads per step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterable, Iterator

import torch

log = logging.getLogger(__name__)

INPUT_BOUND = 0.3  # data_wait fraction above which the loader is the limit
LAUNCH_BOUND_UTIL = 0.5  # GPU utilization below which, with data on time, launches limit
CPU_LAUNCH_BOUND_S = 1e-3  # a CPU step this short is dominated by per-op dispatch


def _nvml_utilization(device: torch.device) -> float | None:
    try:
        return torch.cuda.utilization(device) / 100.0
    except Exception:  # pynvml missing, or no NVML on this system
        return None


def compile_count() -> int:
    """Frames torch.compile has compiled in this process (first compiles and recompiles)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def is_compiled(net) -> bool:
    """``net`` is a torch.compile module, or DDP around one."""
    inner = getattr(net, "module", net)
    return type(net).__name__ == "OptimizedModule" or type(inner).__name__ == "OptimizedModule"


class EpochClock:
    """Per-epoch timing; one per trainer. Cheap enough to stay on (parity runs include it)."""

    def __init__(self, device: torch.device, loader=None, compiled: bool = False):
        self.device = torch.device(device)
        self.loader = loader
        self.cuda = self.device.type == "cuda"
        self.compiled = compiled
        self._events: tuple | None = None
        self.aside_total = 0.0  # validation and checkpoints since the clock was made
        self._reset()

    def _reset(self) -> None:
        self.data = self.step = self.aside_s = 0.0
        self.steps = 0
        self._device_ms: list[float] = []
        self._util: list[float] = []
        self._compiles = compile_count() if self.compiled else 0
        self._start, self._cpu = time.perf_counter(), time.process_time()

    # ------------------------------------------------------------------ per step

    def batches(self, iterable: Iterable) -> Iterator:
        """Yield from ``iterable``, adding each wait for the next batch to ``data``."""
        iterator = iter(iterable)
        clock = time.perf_counter
        while True:
            started = clock()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.data += clock() - started
            yield batch

    def step_started(self) -> float:
        return time.perf_counter()

    def step_ended(self, started: float) -> None:
        self.step += time.perf_counter() - started
        self.steps += 1

    def sample_device(self, step_fn):
        """``step_fn()`` between CUDA events (GPU only); the elapsed time is read later."""
        self._read_events()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = step_fn()
        end.record()
        self._events = (start, end)
        util = _nvml_utilization(self.device)
        if util is not None:
            self._util.append(util)
        return result

    def _read_events(self, wait: bool = False) -> None:
        if self._events is None:
            return
        start, end = self._events
        if wait or end.query():
            end.synchronize()
            self._device_ms.append(start.elapsed_time(end))
            self._events = None

    @contextlib.contextmanager
    def aside(self):
        """Validation and checkpointing: counted apart from the steps."""
        started = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - started
            self.aside_s += spent
            self.aside_total += spent

    # ------------------------------------------------------------------ per epoch

    def report(self) -> dict[str, float]:
        """This epoch's breakdown (and start the next epoch's)."""
        wall = max(time.perf_counter() - self._start, 1e-9)
        self._read_events(wait=True)
        parts = {"data_wait": self.data, "train_step": self.step,
                 "validation_checkpoint": self.aside_s}
        parts["overhead"] = max(0.0, wall - sum(parts.values()))
        total = sum(parts.values())
        out = {"epoch_s": wall, "cpu_s": time.process_time() - self._cpu, "steps": self.steps,
               "batch_ms": 1e3 * self.step / max(1, self.steps)}
        out.update({k: v / total for k, v in parts.items()})
        if self._device_ms:
            out["device_batch_ms"] = sorted(self._device_ms)[len(self._device_ms) // 2]
        if self._util:
            out["device_util"] = sum(self._util) / len(self._util)
        if self.compiled:
            out["compiles"] = compile_count() - self._compiles
        self._reset()
        return out

    def log_epoch(self, logger, epoch: int, step: int, first: bool, warm: bool) -> None:
        """Where epoch ``epoch``'s time went: to ``logger`` (history) every epoch, to the
        log once (``first``); a recompile after warm-up (``warm``) is warned about."""
        report = self.report()
        logger.log({"split": "time", "epoch": epoch, "step": step, **report})
        if warm and report.get("compiles"):
            log.warning("torch.compile recompiled %d time(s) in epoch %d, after warm-up; "
                        "TORCH_LOGS=recompiles says why", report["compiles"], epoch)
        if first:
            log.info(self.summary(epoch, report))
            lever = self.lever(report)
            if lever:
                log.info(lever)

    def lever(self, report: dict[str, float]) -> str | None:
        """One line naming the lever, when the run is clearly input- or launch-bound."""
        if report["data_wait"] >= INPUT_BOUND:
            workers = getattr(self.loader, "num_workers", 0)
            pinned = getattr(self.loader, "pin_memory", False)
            hint = f"raise dataloaders.train.config.num_workers (now {workers})"
            if self.cuda and not pinned:
                hint += " and set pin_memory: true"
            return (f"input-bound: {report['data_wait']:.0%} of the epoch waiting for data; "
                    f"{hint}")
        util = report.get("device_util")
        if self.cuda and util is not None and util < LAUNCH_BOUND_UTIL:
            return (f"launch-bound: the GPU is busy {util:.0%} of the time with data on time; "
                    "set trainer.config.compile: true (compile_mode: reduce-overhead)")
        if not self.cuda and report["train_step"] > 0.5 and \
                report["batch_ms"] < 1e3 * CPU_LAUNCH_BOUND_S:
            return (f"launch-bound: {report['batch_ms']:.2f} ms micro-batches are mostly "
                    "per-operation dispatch; try trainer.config.compile: true, or a larger batch")
        return None

    def summary(self, epoch: int, report: dict[str, float]) -> str:
        shares = ", ".join(f"{k.replace('_', ' ', 1)} {report[k]:.0%}" for k in
                           ("data_wait", "train_step", "overhead", "validation_checkpoint"))
        extra = ""
        if "device_batch_ms" in report:
            extra += f", device {report['device_batch_ms']:.2f} ms/batch"
        if "device_util" in report:
            extra += f", GPU busy {report['device_util']:.0%}"
        return (f"where the time went in epoch {epoch} ({report['epoch_s']:.2f} s): {shares}; "
                f"{report['batch_ms']:.2f} ms/batch{extra}")

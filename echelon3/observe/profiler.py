"""``trainer.config.profile``: torch.profiler over a window of training batches.

```yaml
trainer:
  config:
    profile: {wait: 2, warmup: 2, active: 5, dir: null, stop_after: true, all_ranks: false}
```

Batches are counted from the start of the run (or of the resumed run): the first
``wait`` are skipped, ``warmup`` are profiled and thrown away, ``active`` are
recorded. Rank 0 writes the trace (every rank with ``all_ranks: true``) under
``dir`` (default ``<target.path>/profile``) as ``rank<N>.<time>.pt.trace.json``:
a TensorBoard profiler-plugin run and a Chrome trace (chrome://tracing,
Perfetto). The trace labels ``data_wait`` (waiting for the loader),
``compute`` (forward and backward), ``optimizer`` (the step) and, under DDP,
``all_reduce`` (the gradient hook). With ``stop_after: true`` every rank
stops training after the window (the same batch on every rank).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from echelon3.config.errors import ConfigError
from echelon3.distributed.precision import NOTHING
from echelon3.distributed.ranks import get_rank

log = logging.getLogger(__name__)

KEY = "trainer.config.profile"
DEFAULTS = {"wait": 1, "warmup": 1, "active": 3, "dir": None, "stop_after": False,
            "all_ranks": False}


def settings(spec: Any) -> dict[str, Any] | None:
    """``profile`` checked and completed with defaults; None when not set."""
    if spec is None or spec is False:
        return None
    spec = {} if spec is True else spec
    if not isinstance(spec, dict):
        raise ConfigError(KEY, f"must be a mapping of {', '.join(DEFAULTS)}, got {spec!r}")
    for key in spec:
        if key not in DEFAULTS:
            raise ConfigError(f"{KEY}.{key}", f"unknown key; profile takes {', '.join(DEFAULTS)}")
    out = {**DEFAULTS, **spec}
    for key in ("wait", "warmup", "active"):
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < (key == "active"):
            raise ConfigError(f"{KEY}.{key}", f"must be an integer >= {int(key == 'active')}, "
                              f"got {value!r}")
    for key in ("stop_after", "all_ranks"):
        if not isinstance(out[key], bool):
            raise ConfigError(f"{KEY}.{key}", f"must be true or false, got {out[key]!r}")
    return out


class Profiler:
    """What the trainer calls: ``label`` around work, ``batches`` over the loader, ``step``."""

    def __init__(self, spec: Any, default_dir: str | Path):
        self.spec = settings(spec)
        self.count = 0
        self._prof = None
        self.active = False  # profiling now (labels are recorded)
        if self.spec is not None:
            self.window = self.spec["wait"] + self.spec["warmup"] + self.spec["active"]
            self.dir = Path(self.spec["dir"] or Path(default_dir) / "profile")

    @property
    def enabled(self) -> bool:
        return self.spec is not None

    def start(self) -> None:
        if not self.enabled or not (self.spec["all_ranks"] or get_rank() == 0):
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # warmup: 0 is the user's choice, not news
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            window = schedule(wait=self.spec["wait"], warmup=self.spec["warmup"],
                              active=self.spec["active"], repeat=1)
        self._prof = profile(
            activities=activities,
            schedule=window,
            on_trace_ready=tensorboard_trace_handler(str(self.dir),
                                                     worker_name=f"rank{get_rank()}"))
        self._prof.start()
        self.active = True
        log.info("profiling batches %d-%d into %s", self.spec["wait"] + self.spec["warmup"] + 1,
                 self.window, self.dir)

    def stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof, self.active = None, False

    def label(self, name: str):
        """A ``record_function`` region while profiling, else nothing."""
        return torch.profiler.record_function(name) if self._prof is not None \
            else NOTHING

    def batches(self, loader: Iterable) -> Iterable:
        """The loader's batches, the wait for each one labelled ``data_wait`` while
        profiling (else the loader itself: no layer per batch)."""
        return loader if self._prof is None else self._labelled(loader)

    def _labelled(self, loader: Iterable) -> Iterator:
        iterator = iter(loader)
        while True:
            with self.label("data_wait"):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch

    def step(self) -> bool:
        """After every batch; True when the window is over and the run should stop."""
        if not self.enabled:
            return False
        self.count += 1
        if self._prof is not None:
            self._prof.step()
            if self.count >= self.window:
                self.stop()
        if self.count == self.window:
            log.info("profile written under %s", self.dir)
        return self.spec["stop_after"] and self.count >= self.window

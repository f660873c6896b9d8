"""What a NaN or infinite training loss does: ``trainer.config.nan_policy``.

``stop`` (the default) ends the run at the first non-finite loss with one line
naming the epoch, the step and the loss term. It never makes the host wait for
the device: the step's loss tensors are only kept, and at each log point those
of the interval before are looked at (long finished on the device); before
every validation all of them are, so nothing trained past a bad step is ever
saved, as best or as a checkpoint. The last checkpoint stays the one to resume
from.

``skip`` leaves out every step whose loss is not finite on some rank (no
optimizer step) and reports how many it left out. Deciding before the step
costs one host sync per step (and one all-reduce under DDP), as a GradScaler
does. Under fp16 the GradScaler skips steps whose gradients overflow; their
loss is finite, so they are not counted here.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from echelon3.dist import all_gather_object, all_reduce_sum_, get_rank, get_world_size
from echelon3.errors import ConfigError, UserError

log = logging.getLogger(__name__)

POLICIES = ("stop", "skip")
KEY = "trainer.config.nan_policy"


class NonFiniteLoss(UserError):
    """The loss became NaN or infinite under ``nan_policy: stop``."""


class NonFiniteGuard:
    """Built by the trainer from ``nan_policy``; sees every step's loss tensors."""

    def __init__(self, policy: str = "stop", closure: bool = False):
        if policy not in POLICIES:
            raise ConfigError(KEY, f"must be one of {', '.join(POLICIES)}, got {policy!r}")
        if policy == "skip" and closure:
            raise ConfigError(KEY, "'skip' cannot undo the steps of a closure optimizer "
                              "(SAMOptimizer, LBFGS); use 'stop'")
        self.policy = policy
        # Steps kept since the last check, and those of the interval before (see check).
        self.window: list[tuple[int, int, Mapping[str, torch.Tensor]]] = []
        self.previous: list[tuple[int, int, Mapping[str, torch.Tensor]]] = []
        self.skipped = 0  # steps left out in this attempt
        self.skipped_in_epoch = 0

    # ------------------------------------------------------------------ skip

    def skip(self, loss: torch.Tensor) -> bool:
        """Under ``skip``: True when this step's loss is not finite on some rank."""
        if self.policy != "skip":
            return False
        bad = (~torch.isfinite(loss.detach())).float().reshape(1)
        if get_world_size() > 1:
            all_reduce_sum_(bad)
        if bad.item() == 0:
            return False
        self.skipped += 1
        self.skipped_in_epoch += 1
        return True

    def end_epoch(self, epoch: int) -> None:
        if self.skipped_in_epoch:
            log.warning("epoch %d: skipped %d step(s) whose loss was not finite (%s: skip)",
                        epoch, self.skipped_in_epoch, KEY)
        self.skipped_in_epoch = 0

    def end_fit(self) -> None:
        if self.policy == "skip":
            log.info("%d step(s) skipped for a non-finite loss in this run", self.skipped)

    # ------------------------------------------------------------------ stop

    def observe(self, epoch: int, step: int, parts: Mapping[str, torch.Tensor]) -> None:
        """Keep the step's loss tensors (no sync) for a later :meth:`check`."""
        if self.policy == "stop" and parts:
            self.window.append((epoch, step, parts))

    def check(self, lagged: bool = False) -> None:
        """Raise :class:`NonFiniteLoss` if a kept step had a non-finite loss on any rank.

        ``lagged``: look only at the steps kept before the previous call, which the device
        has long finished, so the host never waits (each log point); without it, at every
        step kept so far (before a validation, which saves)."""
        if self.policy != "stop":
            return
        if lagged:
            window, self.previous, self.window = self.previous, self.window, []
        else:
            window, self.previous, self.window = self.previous + self.window, [], []
        if not window:
            return  # the same on every rank: they all run the same steps
        names = [n for n in window[0][2] if n != "loss"] + ["loss"]
        values = torch.stack([torch.stack([p[n].detach().float().reshape(()) for n in names])
                              for _, _, p in window])
        bad = ~torch.isfinite(values)
        flag = bad.any().float().reshape(1)
        if get_world_size() > 1:
            all_reduce_sum_(flag)
        if flag.item() == 0:
            return
        first = None
        if bad.any():
            row, column = (int(i) for i in bad.nonzero()[0])
            epoch, step, _ = window[row]
            first = (epoch, step, names[column], str(values[row, column].item()), get_rank())
        found = [f for f in all_gather_object(first) if f is not None]
        epoch, step, name, value, rank = min(found, key=lambda f: (f[1], f[4]))
        where = f" on rank {rank}" if get_world_size() > 1 else ""
        raise NonFiniteLoss(None, f"non-finite loss at epoch {epoch}, step {step}: loss term "
                            f"'{name}' is {value}{where}; stopped before saving anything "
                            f"from this step on ({KEY}: stop; 'skip' leaves such steps out)")

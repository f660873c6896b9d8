"""What a NaN or infinite training loss does: ``trainer.config.nan_policy``.

``stop`` (the default) ends the run at the first non-finite loss with one line
naming the epoch, the step and the loss term. It never makes the host wait for
the device: each optimizer step's loss tensors are only kept; at each log point
a flag for the interval just ended joins the log point's one collective, which
is read at the next log point (long finished on the device). Before anything
is saved (a validation's best.tar, an epoch's or a preemption's checkpoint)
every kept step is looked at, and the weights too, so nothing trained past a bad
step is ever saved. The last checkpoint stays the one to resume from.

``skip`` leaves out every optimizer step whose window had a non-finite loss on
some rank: no optimizer step, the window's losses are left out of the records,
and it is counted once. Deciding costs one host sync per optimizer step (and one
all-reduce under DDP), as a GradScaler does. Under fp16 the GradScaler skips
steps whose gradients overflow; their loss is finite, so they are not counted here.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import torch

from echelon3.config.errors import ConfigError, UserError
from echelon3.distributed.fsdp import local
from echelon3.distributed.ranks import all_gather_object, all_reduce_sum_, get_rank, get_world_size
from echelon3.trainers.state import own

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
        # Steps kept since the last log point, and those of earlier intervals whose flag
        # has not been read yet (oldest first).
        self.window: list[tuple[int, int, Mapping[str, torch.Tensor]]] = []
        self.unread: list[list[tuple[int, int, Mapping[str, torch.Tensor]]]] = []
        self.skipped = 0  # steps left out in this attempt
        self.skipped_in_epoch = 0

    # ------------------------------------------------------------------ skip

    def poisoned(self, losses: Sequence[Mapping[str, torch.Tensor]]) -> bool:
        """Under ``skip``: whether a window (its micro-batches' losses) had a non-finite
        loss on some rank; counted once when it had."""
        if self.policy != "skip":
            return False
        bad = torch.stack([(~torch.isfinite(p["loss"].detach())).any() for p in losses]).any()
        bad = bad.float().reshape(1)
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

    def observe(self, epoch: int, step: int,
                losses: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Keep an optimizer step's losses (one mapping per micro-batch; no sync)."""
        if self.policy == "stop":
            for parts in losses:
                self.window.append((epoch, step, parts))

    def close_interval(self) -> None:
        """A log point: the steps kept since the last one wait for its collective. Its
        summed loss means are the flag (read one interval later): a non-finite term makes
        the weighted total non-finite (inf and NaN carry through sums and products, 0 x inf
        is NaN), and so the mean and the sum over ranks; check() names the term."""
        kept, self.window = self.window, []
        self.unread.append(kept)

    def read(self, sums: Sequence[float] | None) -> None:
        """The oldest unread interval's loss means, summed over ranks (None: it held no
        step), came back: forget its steps when they are finite, else name the first bad
        step (raises; a false alarm, finite values whose sum overflowed, passes)."""
        if sums is not None and not all(math.isfinite(v) for v in sums):
            self.check()
        elif self.unread:
            self.unread.pop(0)

    def check(self) -> None:
        """Raise :class:`NonFiniteLoss` if any kept step had a non-finite loss on any rank
        (a host sync; before anything is saved)."""
        if self.policy != "stop":
            return
        window = [step for interval in self.unread for step in interval] + self.window
        self.unread, self.window = [], []
        bad = torch.zeros((), dtype=torch.bool)
        if window:
            names, values = _values(window)
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

    def check_before_save(self, params) -> None:
        """Nothing non-finite is ever saved: the kept losses (above) and the weights."""
        self.check()
        # each rank its own shard under FSDP; the sum below covers them all
        flag = torch.stack([(~torch.isfinite(local(p.detach()))).any() for p in params]).any()
        flag = flag.float().reshape(1)
        if get_world_size() > 1:
            all_reduce_sum_(flag)
        if flag.item() > 0:
            raise NonFiniteLoss(None, "the weights are not finite (a loss was finite but an "
                                "update overflowed); refusing to save them. Lower the "
                                "learning rate or use precision bf16/fp32")

    # ------------------------------------------------------------------ mid-epoch state

    def mid_epoch_state(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "skipped_in_epoch": self.skipped_in_epoch}

    def load_mid_epoch_state(self, ranks: Sequence[Mapping[str, Any]], rank: int) -> None:
        saved = own(ranks, rank)
        self.skipped = int(saved.get("skipped", 0))
        self.skipped_in_epoch = int(saved.get("skipped_in_epoch", 0))


def _values(window) -> tuple[list[str], torch.Tensor]:
    """(names, [steps x names] values) of kept steps; the total ``loss`` last."""
    names = [n for n in window[0][2] if n != "loss"] + ["loss"]
    return names, torch.stack([torch.stack([p[n].detach().float().reshape(()) for n in names])
                               for _, _, p in window])

"""The one decision per micro-batch: wait, step or skip (``grad_accum_steps``, ``nan_policy``).

Windows are counted from the start of each epoch: micro-batch ``i`` belongs to
the window starting at ``i - i % N``; the last window of an epoch holds what is
left (``steps % N`` batches when N does not divide the epoch). Each loss is
divided by the size of its window, so a window of N micro-batches of B samples
makes the same gradient as one batch of N x B. Under DDP every micro-batch but
the last of a window runs under ``no_sync``: one all-reduce per window.

After each micro-batch's backward :meth:`Stepping.decide` answers:

- ``wait``: the window is still open;
- ``step``: the window is complete: step the optimizer;
- ``skip``: the window is complete but some micro-batch of it, on some rank, had
  a non-finite loss (``nan_policy: skip``): no optimizer step, the window's
  gradients and losses are dropped, and it counts as one skipped step. Deciding
  costs one host sync (and one 1-element all-reduce under DDP) per optimizer
  step, as a GradScaler does; under ``stop`` nothing is read here.

Either way the window counts as one step of ``global_step``, so step numbers
mean the same with and without skips (a GradScaler's overflow skip counts too).

Mid-epoch state (:meth:`Stepping.mid_epoch_state`): the open window's size so
far, its micro-batches' losses and this rank's accumulated gradients, unscaled
(divided by the GradScaler's scale; ``None`` stays ``None``), with the precision
they were made in. A resume under another precision while a window is open is
refused; at the same world size each rank takes back its own gradients, at
another one every rank takes their mean (the window's all-reduce averages anyway).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from echelon3.config.errors import ConfigError
from echelon3.distributed.fsdp import like, no_sync, sharded_module
from echelon3.distributed.precision import NOTHING
from echelon3.distributed.ranks import get_world_size
from echelon3.trainers.state import own

KEY = "trainer.config.grad_accum_steps"
WAIT, STEP, SKIP = "wait", "step", "skip"


class Stepping:
    """Built by the trainer; ``guard`` is its :class:`~echelon3.trainers.nonfinite.NonFiniteGuard`."""

    def __init__(self, steps: Any, guard, precision, params, closure: bool = False):
        """``params``: a callable giving the optimizer's parameters, in order."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(KEY, f"must be a positive integer, got {steps!r}")
        if closure and steps > 1:
            raise ConfigError(KEY, "must be 1 with a closure optimizer (SAMOptimizer, LBFGS): "
                              "they evaluate the loss several times per step")
        self.steps, self.guard, self.precision, self.params = steps, guard, precision, params
        self.skips = guard.policy == "skip"  # under stop nothing is read when a window closes
        self.losses: list[Mapping[str, torch.Tensor]] = []  # the open window's micro-batches
        self._started = False

    def window(self, index: int, total: int | None) -> tuple[float, bool]:
        """(loss scale, closes the window?) for micro-batch ``index`` (0-based) of ``total``
        (None: a stream of unknown length, whose windows are all full)."""
        start = index - index % self.steps
        size = self.steps if total is None else min(self.steps, total - start)
        return 1.0 / size, index == start + size - 1

    def windows_in(self, total: int) -> int:
        return -(-total // self.steps)

    @staticmethod
    def syncs(net) -> bool:
        """Whether ``net`` all-reduces in its backward (DDP, FSDP): :meth:`sync` matters."""
        return isinstance(net, DistributedDataParallel) or sharded_module(net) is not None

    def sync(self, net, last: bool):
        """DDP's ``no_sync`` (FSDP's counterpart) for every micro-batch but the last of a window.

        DDP's ``static_graph`` records the graph in its first iteration, which
        must all-reduce; an extra all-reduce inside a window changes no result
        (averaging is linear), so the very first micro-batch syncs there.
        """
        first, self._started = not self._started, True
        if not last and sharded_module(net) is not None:
            return no_sync(net)  # FSDP's counterpart
        if last or not isinstance(net, DistributedDataParallel) or (first and net.static_graph):
            return NOTHING
        return net.no_sync()

    def decide(self, parts: Mapping[str, torch.Tensor], last: bool) -> str:
        """After a micro-batch's backward: ``wait``, ``step`` or ``skip``."""
        self.losses.append(parts)
        if not last:
            return WAIT
        return SKIP if self.skips and self.guard.poisoned(self.losses) else STEP

    def close(self, optimizer, decision: str) -> list[Mapping[str, torch.Tensor]]:
        """End the window; its micro-batches' losses, or [] when it was skipped."""
        losses, self.losses = self.losses, []
        if decision == SKIP:
            optimizer.zero_grad(set_to_none=True)
            return []
        return losses

    # ------------------------------------------------------------------ mid-epoch state

    def mid_epoch_state(self) -> dict[str, Any]:
        params = self.params()
        if not self.losses:
            return {}
        scale = self.precision.grad_scale()
        grads = [None if p.grad is None else (p.grad.detach().float() / scale).to(p.dtype).cpu()
                 for p in params]
        names = list(self.losses[0])
        losses = torch.stack([torch.stack([p[n].detach().float().reshape(()) for n in names])
                              for p in self.losses]).cpu()
        return {"precision": self.precision.mode, "names": names, "losses": losses,
                "grads": grads}

    def load_mid_epoch_state(self, saved: Sequence[dict], rank: int) -> None:
        """``saved``: every rank's :meth:`mid_epoch_state`, in rank order."""
        mine, params = own(saved, rank), self.params()
        if not mine:
            return
        if mine["precision"] != self.precision.mode:
            raise ConfigError("trainer.config.precision", f"the checkpoint was written in "
                              f"{mine['precision']} with a gradient accumulation window open "
                              f"({len(mine['losses'])} of {self.steps} micro-batches); resume "
                              f"with precision {mine['precision']}, or from the epoch's "
                              "checkpoint")
        grads = mine["grads"]
        if len(saved) != get_world_size():
            grads = _mean_grads([s["grads"] for s in saved])
        scale = self.precision.grad_scale()
        for p, g in zip(params, grads):
            p.grad = None if g is None else like(p, (g.to(device=p.device, dtype=torch.float32)
                                                     * scale).to(p.dtype))
        self.losses = [dict(zip(mine["names"], row.to(params[0].device).unbind(0)))
                       for row in mine["losses"]]


def _mean_grads(per_rank: list[list]) -> list:
    out = []
    for grads in zip(*per_rank):
        present = [g.float() for g in grads if g is not None]
        out.append(None if not present else torch.stack(present).sum(0) / len(grads))
    return out

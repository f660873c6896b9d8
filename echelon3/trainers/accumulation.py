"""Gradient accumulation: ``trainer.config.grad_accum_steps`` micro-batches per optimizer step.

Windows are counted from the start of each epoch: micro-batch ``i`` belongs to
the window starting at ``i - i % N``; the last window of an epoch holds what is
left (``steps % N`` batches when N does not divide the epoch). Each loss is
divided by the size of its window, so a window of N micro-batches of B samples
makes the same gradient as one batch of N x B. Under DDP every micro-batch but
the last of a window runs under ``no_sync``: one all-reduce per window.

A checkpoint taken inside a window (a mid-epoch save) carries the gradients
accumulated so far, averaged over the ranks; averaging is linear, so the
window's final all-reduce gives the same result after a resume.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch
from torch.nn.parallel import DistributedDataParallel

from echelon3.dist import all_reduce_sum_, get_world_size
from echelon3.errors import ConfigError

KEY = "trainer.config.grad_accum_steps"


class Accumulation:
    def __init__(self, steps: Any = 1, closure: bool = False):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(KEY, f"must be a positive integer, got {steps!r}")
        if closure and steps > 1:
            raise ConfigError(KEY, "must be 1 with a closure optimizer (SAMOptimizer, LBFGS): "
                              "they evaluate the loss several times per step")
        self.steps = steps
        self.pending = 0  # micro-batches accumulated in the open window
        self._started = False

    def window(self, index: int, total: int) -> tuple[float, bool]:
        """(loss scale, steps now?) for micro-batch ``index`` (0-based) of ``total``."""
        start = index - index % self.steps
        size = min(self.steps, total - start)
        return 1.0 / size, index == start + size - 1

    def sync(self, net, last: bool):
        """DDP's ``no_sync`` for every micro-batch but the last of a window.

        DDP's ``static_graph`` records the graph in its first iteration, which
        must all-reduce; an extra all-reduce inside a window changes no result
        (averaging is linear), so the very first micro-batch syncs there.
        """
        self.pending = 0 if last else self.pending + 1
        first, self._started = not self._started, True
        if last or not isinstance(net, DistributedDataParallel) or (first and net.static_graph):
            return contextlib.nullcontext()
        return net.no_sync()

    def drop(self, optimizer) -> None:
        """Forget the open window's gradients (a skipped non-finite micro-batch)."""
        optimizer.zero_grad(set_to_none=True)
        self.pending = 0

    def state_dict(self, params: Iterable[torch.nn.Parameter]) -> dict[str, Any]:
        """The open window's gradients (rank average), or {} between windows."""
        if not self.pending:
            return {}
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for p in params]
        if get_world_size() > 1:
            all_reduce_sum_(*grads)
            for g in grads:
                g.div_(get_world_size())
        return {"accum_pending": self.pending, "accum_grads": [g.cpu() for g in grads]}

    def load_state_dict(self, state: dict[str, Any], params: Iterable[torch.nn.Parameter]) -> None:
        self.pending = int(state.get("accum_pending") or 0)
        for p, g in zip(params, state.get("accum_grads") or []):
            p.grad = g.to(device=p.device, dtype=p.dtype).clone()

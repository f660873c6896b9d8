"""A log point's one collective, read one log point later.

Every ``log_every_n_steps`` optimizer steps the trainer gathers what needs all
ranks: the interval's mean losses, the non-finite flag of its steps and, under
DDP, whether a rank received a preemption signal. :meth:`LogPoint.exchange`
starts one asynchronous all-reduce over all of it and returns what the previous
log point started, read now: by then the device has long finished it, so the
host never waits for the device and no step but a log point runs a collective.
(On the CPU, under gloo, the all-reduce runs at once: there is no device queue.)
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as tdist

from echelon3.distributed.ranks import get_world_size


class LogPoint:
    def __init__(self):
        self._pending = None

    def exchange(self, record: dict | None, values: Mapping[str, torch.Tensor]):
        """Start summing ``values`` (tensors on one device) over the ranks; return the
        previous exchange as ``(record, {name: [floats]})``, or None."""
        previous = self.flush()
        names = list(values)
        sizes = [values[n].numel() for n in names]
        flat = torch.cat([values[n].detach().float().reshape(-1) for n in names])
        work = None
        if get_world_size() > 1 and flat.is_cuda:  # NCCL: queued behind the step, read later
            work = tdist.all_reduce(flat, async_op=True)
        elif get_world_size() > 1:  # gloo on the CPU: no device queue to wait behind
            tdist.all_reduce(flat)
        self._pending = (record, names, sizes, flat, work)
        return previous

    def flush(self):
        """Read the exchange in flight now (at the end of an epoch or before saving)."""
        if self._pending is None:
            return None
        record, names, sizes, flat, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        numbers, out, at = flat.tolist(), {}, 0
        for name, size in zip(names, sizes):
            out[name], at = numbers[at:at + size], at + size
        return record, out

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


class LogPoints:
    """Step 5 of the trainer's order, mixed into the trainer (which provides the running
    losses, the non-finite guard, clipping, the logger and the step checkpoints' clock)."""

    def _log_point(self, epoch: int) -> None:
        """Start this interval's collective, act on the previous one's."""
        from echelon3.distributed import preemption

        means = self.running.take()
        values = {"bad": self.nonfinite.interval_flag(self.device)}
        if get_world_size() > 1:
            values["stop"] = torch.tensor(float(preemption.requested() is not None),
                                          device=self.device)
        if self.step_saving.timed:  # rank 0's clock decides, every rank learns it here
            values["save"] = torch.tensor(float(self.step_saving.time_is_up()),
                                          device=self.device)
        if means is not None:
            values["losses"] = means
        norms = self.clipping.take(get_world_size())
        if norms is not None:
            values["grad_norm"] = norms
        record = {"split": "train", "epoch": epoch, "step": self.global_step, "lr": self._lr}
        self._act(self.logpoint.exchange(record if means is not None else None, values))

    def _flush_logs(self) -> None:
        self._act(self.logpoint.flush())

    def _act(self, read) -> None:
        if read is None:
            return
        record, values = read
        self.nonfinite.read(values["bad"][0])
        if record is not None:
            record = self.running.fill(record, values["losses"])
            if "grad_norm" in values:
                record["grad_norm"] = self.clipping.read(values["grad_norm"])
            self.logger.log(record)
            if self._bar is not None:
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if values.get("stop", [0])[0] > 0:
            self._stop = True
        if values.get("save", [0])[0] > 0:
            self.step_saving.due = True

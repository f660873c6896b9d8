"""A log point's one collective, read one log point later.

Every ``log_every_n_steps`` optimizer steps the trainer gathers what needs all
ranks: the interval's mean losses (non-finite when one of its steps' losses was:
the non-finite guard's flag) and, under DDP, whether a rank received a
preemption signal. :meth:`LogPoint.exchange`
starts one asynchronous all-reduce over all of it and returns what the previous
log point started, read now: by then the device has long finished it, so the
host never waits for the device and no step but a log point runs a collective.
(On the CPU, under gloo, the all-reduce runs at once: there is no device queue.)
"""

from __future__ import annotations

import time
from typing import Mapping

import torch
import torch.distributed as tdist

from echelon3.distributed.ddp import hint_unused_search
from echelon3.distributed.ranks import get_world_size


class LogPoint:
    def __init__(self):
        self._pending = None
        self.read_at, self.synced = 0.0, False  # when the last exchange read its previous


    def exchange(self, record: dict | None, values: Mapping[str, torch.Tensor]):
        """Start summing ``values`` (tensors on one device) over the ranks; return the
        previous exchange as ``(record, {name: [floats]})``, or None."""
        previous = self.flush()
        # Reading a device's numbers waits for all it was given: the wall clock now is
        # the device's too (on the CPU always).
        self.read_at = time.perf_counter()
        self.synced = previous is not None or not any(v.is_cuda for v in values.values())
        if get_world_size() == 1:  # nothing to sum: each tensor is read as it is
            self._pending = (record, values, None)
            return previous
        names = {n: v.numel() for n, v in values.items()}
        # float64: counts of samples and tokens stay exact (float32 is exact below 2**24)
        flat = torch.cat([values[n].detach().double().reshape(-1) for n in names])
        work = None
        if flat.is_cuda:  # NCCL: queued behind the step, read later
            work = tdist.all_reduce(flat, async_op=True)
        else:  # gloo on the CPU: no device queue to wait behind
            tdist.all_reduce(flat)
        self._pending = (record, names, (flat, work))
        return previous

    def flush(self):
        """Read the exchange in flight now (at the end of an epoch or before saving)."""
        if self._pending is None:
            return None
        record, held, summed = self._pending  # held: {name: tensor} or {name: size}
        self._pending = None
        if summed is None:
            return record, {name: t.reshape(-1).tolist() for name, t in held.items()}
        flat, work = summed
        if work is not None:
            work.wait()
        numbers, out, at = flat.tolist(), {}, 0
        for name, size in held.items():
            out[name], at = numbers[at:at + size], at + size
        return record, out


class LogPoints:
    """Step 5 of the trainer's order, mixed into the trainer (which provides the running
    losses, the non-finite guard, clipping, the throughput, the logger and the step
    checkpoints' clock)."""

    _ddp_hinted = False  # the unused-parameter search's hint is said once (distributed/ddp.py)

    def clock_aside(self) -> float:
        """Seconds spent in validation and checkpoints so far (out of the throughput)."""
        clock = getattr(self, "_clock", None)
        return 0.0 if clock is None else clock.aside_total

    def _log_point(self, epoch: int) -> None:
        """Start this interval's collective, act on the previous one's."""
        from echelon3.distributed import preemption

        means = self.running.take()
        if means is not None and not self._ddp_hinted:  # until DDP's figures are in
            self._ddp_hinted = hint_unused_search(self.net)
        self.nonfinite.close_interval()
        values = {}
        if get_world_size() > 1:
            values["stop"] = torch.tensor(float(preemption.requested() is not None),
                                          device=self.device)
        if self.step_saving.timed:  # rank 0's clock decides, every rank learns it here
            values["save"] = torch.tensor(float(self.step_saving.time_is_up()),
                                          device=self.device)
        if means is not None:
            values["losses"] = means
            seen = self.throughput.take()
            if get_world_size() > 1:
                values["seen"] = torch.tensor(seen, dtype=torch.float64, device=self.device)
        norms = self.clipping.take(get_world_size())
        if norms is not None:
            values["grad_norm"] = norms
        record = {"split": "train", "epoch": epoch, "step": self.global_step, "lr": self._lr}
        self._act(self.logpoint.exchange(record if means is not None else None, values))
        if means is not None:
            self.throughput.mark(record, self.logpoint.read_at, self.logpoint.synced,
                                 self.global_step, self.clock_aside(), seen)

    def _flush_logs(self) -> None:
        read = self.logpoint.flush()
        self.throughput.settle(time.perf_counter(), self.clock_aside())
        self._act(read)

    def _act(self, read) -> None:
        if read is None:
            return
        record, values = read
        self.nonfinite.read(values.get("losses"))
        if record is not None:
            record = self.running.fill(record, values["losses"])
            record = self.throughput.fill(record, values.get("seen"))
            if "grad_norm" in values:
                record["grad_norm"] = self.clipping.read(values["grad_norm"])
            self.logger.log(record)
            if self._bar is not None:
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if values.get("stop", [0])[0] > 0:
            self._stop = True
        if values.get("save", [0])[0] > 0:
            self.step_saving.due = True

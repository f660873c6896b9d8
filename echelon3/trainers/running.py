"""Running means of the train losses between log points, without a host sync per step.

Each step hands over its loss tensors, detached, and nothing else happens. At a
log point the steps' values are stacked and averaged on the device (under DDP,
one all-reduce), and the numbers are read one log point later, or at the end of
the epoch, when the device has long finished them: logging never makes the host
wait for the device.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from echelon3.dist import all_reduce_sum_, get_world_size


class RunningLosses:
    """``names``: ``loss`` (the total) and each part; ``same_as_total``: one loss of
    weight 1, whose part is the total itself (one value per step instead of two)."""

    def __init__(self, names: Sequence[str], same_as_total: bool):
        self.names = list(names)
        self.same_as_total = same_as_total
        self._steps: list[torch.Tensor] = []
        self._pending: tuple[dict, torch.Tensor] | None = None

    def add(self, values: Mapping[str, torch.Tensor]) -> None:
        """One step's detached losses, by name (none: a step left out)."""
        if not values:
            return
        if self.same_as_total:
            self._steps.append(values["loss"])
        else:
            self._steps.append(torch.stack([values[name] for name in self.names]))

    def close_interval(self, record: dict) -> dict | None:
        """Start this interval's mean on the device; return the previous interval's record."""
        finished = self.finish()
        if self._steps:
            means = torch.stack(self._steps).float().mean(0) / get_world_size()
            all_reduce_sum_(means)
            self._pending = (record, means)
            self._steps = []
        return finished

    def finish(self) -> dict | None:
        """The record started by the last :meth:`close_interval`, now with its numbers."""
        if self._pending is None:
            return None
        record, means = self._pending
        self._pending = None
        values = means.tolist()
        values = [values] * len(self.names) if self.same_as_total else values
        record.update(zip(self.names, values))
        return record

    # ------------------------------------------------------------------ preemption

    def unlogged(self) -> tuple[dict[str, torch.Tensor], int]:
        """The steps not yet in a record, for a preemption checkpoint: ({"steps": values}, n).
        The per-step values themselves, so the resumed run's mean is bit-for-bit the same."""
        if not self._steps:
            return {}, 0
        return {"steps": torch.stack(self._steps)}, len(self._steps)

    def restore(self, saved: Mapping[str, torch.Tensor], device) -> None:
        """Take back what :meth:`unlogged` gave."""
        self._pending = None
        self._steps = list(saved["steps"].to(device).unbind(0)) if "steps" in saved else []

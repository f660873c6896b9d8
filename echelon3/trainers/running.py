"""Running means of the train losses between log points, without a host sync per step.

Each micro-batch of a completed optimizer step hands over its loss tensors,
detached, and nothing else happens. At a log point :meth:`RunningLosses.take`
averages them on the device; the trainer's log point sums that over the ranks
in its one collective and reads the numbers one log point later
(:mod:`echelon3.trainers.logpoint`), when the device has long finished them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from echelon3.distributed.ranks import get_world_size
from echelon3.trainers.state import own


class RunningLosses:
    """``names``: ``loss`` (the total) and each part; ``same_as_total``: one loss of
    weight 1, whose part is the total itself (one value per step instead of two)."""

    def __init__(self, names: Sequence[str], same_as_total: bool, device=None):
        self.names, self.device = list(names), device
        self.same_as_total = same_as_total
        self._steps: list[torch.Tensor] = []

    def add(self, values: Mapping[str, torch.Tensor]) -> None:
        """One micro-batch's detached losses, by name."""
        if self.same_as_total:
            self._steps.append(values["loss"])
        else:
            self._steps.append(torch.stack([values[name] for name in self.names]))

    def take(self) -> torch.Tensor | None:
        """This rank's share of the interval's means (divided by the world size, so the
        ranks' sum is the mean), on the device; None when the interval holds nothing."""
        if not self._steps:
            return None
        means = torch.stack(self._steps).mean(0, dtype=torch.float32).reshape(-1)
        self._steps = []
        world = get_world_size()
        return means if world == 1 else means.div_(world)

    def fill(self, record: dict, sums: Sequence[float]) -> dict:
        """``record`` with the names' values from :meth:`take`'s sums over the ranks."""
        values = list(sums) * len(self.names) if self.same_as_total else list(sums)
        record.update(zip(self.names, values))
        return record

    # ------------------------------------------------------------------ mid-epoch state

    def mid_epoch_state(self) -> dict[str, Any]:
        """The micro-batches not yet in a record, the values themselves, so the resumed
        run's mean is bit-for-bit the same."""
        return {"steps": torch.stack(self._steps).cpu()} if self._steps else {}

    def load_mid_epoch_state(self, ranks: Sequence[Mapping[str, Any]], rank: int) -> None:
        saved = own(ranks, rank)
        self._steps = list(saved["steps"].to(self.device).unbind(0)) if "steps" in saved else []

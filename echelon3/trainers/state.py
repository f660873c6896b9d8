"""One home for mid-epoch state: what a preemption checkpoint holds beyond an epoch's.

Every per-step component of the trainer is a *part*: it gives this rank's
state as plain data (``mid_epoch_state()``) and takes back every rank's, as
saved (``load_mid_epoch_state(ranks, rank)``: at the same world size a part
takes its own rank's entry, after a world-size change it decides what stands
in). :class:`MidEpoch` asks each part, gathers the ranks (a collective: every
rank calls it) and puts the result under ``"mid_epoch"`` in the checkpoint.

The parts, in the order they are restored: ``position`` (micro-batches done in
the epoch, the RNG states as it began and now, and a stream's loader position), ``nonfinite`` (skip counters),
``stepping`` (the open accumulation window), ``running`` (losses not yet
logged). Network, optimizer, scheduler and GradScaler are in every checkpoint.
A new per-step feature adds a part here, and a case to tests/test_combinations.py.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from echelon3.config.errors import ConfigError
from echelon3.data.loaders import known_length, set_epoch, skip_batches
from echelon3.data.streams import has_position, loader_position, resume_position
from echelon3.data.rng import restore_for_rank, rng_state, set_rng_state
from echelon3.distributed.ranks import all_gather_object, get_world_size

KEY = "mid_epoch"


class Part(Protocol):
    def mid_epoch_state(self) -> dict[str, Any]: ...

    def load_mid_epoch_state(self, ranks: Sequence[dict[str, Any]], rank: int) -> None: ...


def own(ranks: Sequence[Any], rank: int) -> Any:
    """This rank's entry, or rank 0's after a world-size change."""
    return ranks[rank] if len(ranks) == get_world_size() else ranks[0]


class MidEpoch:
    def __init__(self, **parts: Part):
        self.parts = parts

    def state(self) -> dict[str, Any]:
        """Every rank's state of every part (a collective)."""
        mine = {name: part.mid_epoch_state() for name, part in self.parts.items()}
        return {KEY: {"ranks": all_gather_object(mine)}}

    def load(self, checkpoint: Mapping[str, Any], rank: int) -> bool:
        """Restore from a checkpoint; False when it was written at an epoch's end."""
        saved = checkpoint.get(KEY)
        if not saved:
            return False
        ranks = saved["ranks"]
        for name, part in self.parts.items():
            part.load_mid_epoch_state([r[name] for r in ranks], rank)
        return True


class EpochPosition:
    """Where the epoch stands: micro-batches done, RNG states as it began and now.

    The data order is a function of (seed, epoch) (``DistributedSampler``); a resumed
    epoch draws the loader's base seed from the same RNG state as the original one,
    skips the batches done (the sampler skips their indices), then continues with
    the RNG state of the moment the checkpoint was written. A stream
    (:mod:`echelon3.data.streams`) skips nothing: its loader's own position (every
    worker's) is saved and restored, so nothing is read twice."""

    def __init__(self):
        self.step = 0
        self._loader = None
        self.epoch_rng: dict | None = None
        self._resume: dict | None = None
        self._world_changed = False

    def start(self, loader, epoch: int, rank: int):
        """Open ``epoch``'s batches -> (batches, micro-batches already done)."""
        set_epoch(loader, epoch)
        self._loader = loader
        resume, self._resume = self._resume, None
        if resume is not None:
            set_rng_state(resume["epoch_rng"])
            if has_position(loader):
                if self._world_changed and resume.get("loader") is not None:
                    raise ConfigError("nproc", f"the checkpoint holds a stream's position at "
                                      f"another world size ({self._saved_world} processes); "
                                      "resume at that size, or from an epoch's checkpoint")
                resume_position(loader, resume.get("loader"))
            else:
                skip_batches(loader, resume["step"])
        self.epoch_rng = rng_state()
        finished = resume is not None and has_position(loader) and \
            resume["step"] >= (known_length(loader) or float("inf"))
        batches = iter(()) if finished else iter(loader)  # saved after the pass's last batch
        self.step = 0 if resume is None else resume["step"]
        if resume is not None and self._world_changed:
            restore_for_rank(None, resume["rng"], rank, get_world_size())
        elif resume is not None:
            set_rng_state(resume["rng"])
        return batches, self.step

    def mid_epoch_state(self) -> dict[str, Any]:
        state = {"step": self.step, "epoch_rng": self.epoch_rng, "rng": rng_state()}
        if self._loader is not None and has_position(self._loader):
            state["loader"] = loader_position(self._loader)
        return state

    def load_mid_epoch_state(self, ranks: Sequence[dict[str, Any]], rank: int) -> None:
        self._world_changed = len(ranks) != get_world_size()
        self._saved_world = len(ranks)
        self._resume = own(ranks, rank)

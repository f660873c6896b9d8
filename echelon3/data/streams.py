"""Streams: IterableDatasets read once per pass across ranks x loader workers, whose
position goes into a checkpoint.

A stream is split into *shards*, one per (rank, loader worker): shard
``rank * workers + worker`` of ``world_size * workers`` (:func:`shard_info`). A
:class:`Stream` subclass writes its ``__iter__`` over :meth:`Stream.shard`, which
takes this shard's part of the pass's sample indices (every ``count``-th, from the
shard's own) and counts what it hands out::

    class Rows(Stream):
        def __iter__(self):
            for index in self.shard(self.order(len(self.rows))):  # None: endless
                yield self.rows[index] + torch.randn(3, generator=self.generator)

The rank and world size come from the loader builder
(:func:`echelon3.data.loaders.create_dataloader` calls :meth:`Stream.set_shard`), else
from ``torch.distributed`` when it is initialized; the worker from
``torch.utils.data.get_worker_info()``. A plain ``IterableDataset`` that is not a
``Stream`` can call :func:`shard_info` itself.

**Random augmentation.** Before handing out the shard's sample ``k``, :meth:`Stream.shard`
seeds ``self.generator`` (a ``torch.Generator``) from (seed, epoch, shard, k)
(:func:`stream_seed`); in a loader worker it also seeds the worker's global generators
(torch, NumPy, Python) with the same value, as :mod:`echelon3.data.rng` does for a
map-style set. A resumed stream draws the same augmentations. ``seed`` is the stream's
own, or root ``seed`` when it was given none.

**Position.** The train loader of a stream is torchdata's ``StatefulDataLoader``; a
stream's ``state_dict()`` is ``{"drawn": samples handed out on this shard in this
pass, "epoch": ...}``, kept per loader worker, so a loader restored with
:func:`resume_position` continues where it stood without replaying a batch. The
position holds to the same ``num_workers`` and world size.

**Length.** A stream has no ``len()``: ``len(loader)`` raises ``TypeError`` as torch's
does, and the trainer treats the epoch's length as unknown (one pass of a finite stream
is one epoch).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from echelon3.config.errors import ConfigError
from echelon3.data.rng import sample_seed, seed_sample

STATEFUL_MODULE, STATEFUL_TYPE = "torchdata.stateful_dataloader", "StatefulDataLoader"
FINISHED = "_iterator_finished"  # StatefulDataLoader's flag: the pass had ended


def shard_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(this shard's index, the number of shards) for the calling process: ranks x workers.

    ``rank`` / ``world_size``: given by the loader builder; None falls back to
    ``torch.distributed`` when it is initialized, else a single process."""
    if rank is None or world_size is None:
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank, world_size = ((torch.distributed.get_rank(), torch.distributed.get_world_size())
                            if initialized else (0, 1))
    info = get_worker_info()
    worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
    return rank * workers + worker, world_size * workers


def stream_seed(seed: int, epoch: int, shard: int, k: int) -> int:
    """The 63-bit seed of sample ``k`` of ``shard`` in ``epoch``."""
    return sample_seed(sample_seed(seed, epoch, shard), 0, k)


def _own_part(indices: Iterable[int] | None, shard: int, count: int,
              start: int) -> Iterator[int]:
    """This shard's indices from its ``start``-th on, without walking the ones before."""
    if indices is None:
        return itertools.count(shard + start * count, count)
    if hasattr(indices, "__getitem__"):  # a range, list, tensor, array: sliced, not walked
        return iter(indices[shard::count][start:])
    return itertools.islice(indices, shard + start * count, None, count)


class Stream(IterableDataset):
    """An IterableDataset sharded over ranks x workers, with a per-sample generator and a
    position (``state_dict`` / ``load_state_dict``) that StatefulDataLoader keeps."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self.rank: int | None = None
        self.world_size: int | None = None
        self.generator = torch.Generator()
        # Shared memory, so persistent loader workers see each new epoch.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._drawn = 0
        self._resume = 0

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_shard(self, rank: int, world_size: int) -> None:
        """This process's rank among ``world_size`` (the loader builder calls it)."""
        self.rank, self.world_size = int(rank), int(world_size)

    def set_epoch(self, epoch: int) -> None:
        """The pass to draw: a new order (:meth:`order`) and new augmentations."""
        self._epoch.fill_(int(epoch))

    def shard_info(self) -> tuple[int, int]:
        return shard_info(self.rank, self.world_size)

    def order(self, size: int, shuffle: bool = True) -> torch.Tensor:
        """The pass's order of ``size`` sample indices, the same on every shard: a
        permutation drawn from (seed, epoch), or ``0..size-1``."""
        if not shuffle:
            return torch.arange(size)
        generator = torch.Generator().manual_seed(sample_seed(self.seed or 0, self.epoch, -1))
        return torch.randperm(size, generator=generator)

    def shard(self, indices: Iterable[int] | None = None) -> Iterator[int]:
        """This shard's part of ``indices`` (None: an endless ``0, 1, 2, ...``), from where
        the stream was restored; each index handed out with the generators seeded for it."""
        shard, count = self.shard_info()
        start, self._resume = self._resume, 0
        self._drawn = start
        base = sample_seed(self.seed or 0, self.epoch, shard)
        in_worker = get_worker_info() is not None
        for k, index in enumerate(_own_part(indices, shard, count, start), start):
            self.generator.manual_seed(sample_seed(base, 0, k))
            if in_worker:
                seed_sample(base, 0, k)
            self._drawn = k + 1
            yield int(index)

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self._drawn, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = self._drawn = int(state["drawn"])
        self.set_epoch(int(state["epoch"]))


def has_position(loader) -> bool:
    """Whether ``loader`` is a stream's loader that can say where it stands."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return (isinstance(loader, StatefulDataLoader)
            and isinstance(getattr(loader, "dataset", None), IterableDataset))


def loader_position(loader) -> dict | None:
    """Where a stream's loader stands, as plain data (``torch.load(weights_only=True)``
    reads it), or None for a loader without a position. Call it between batches."""
    if not has_position(loader):
        return None
    return {"num_workers": int(loader.num_workers), "loader": loader.state_dict()}


def resume_position(loader, position: dict | None, key: str = "dataloaders.train") -> None:
    """Make the next ``iter(loader)`` continue from ``position`` (:func:`loader_position`).
    A position taken when the pass had ended leaves the next pass to start afresh."""
    if position is None:
        return
    if not has_position(loader):
        raise ConfigError(f"{key}.type", f"a {type(loader).__name__} keeps no position in a "
                          "stream, so this run cannot resume part-way; use "
                          "torch.utils.data.DataLoader (echelon3 then builds a "
                          f"{STATEFUL_MODULE}.{STATEFUL_TYPE})")
    saved = int(position["num_workers"])
    if saved != loader.num_workers:
        raise ConfigError(f"{key}.config.num_workers", f"the stream's position was saved with "
                          f"{saved} loader workers (each a shard of it), not "
                          f"{loader.num_workers}; resume with num_workers: {saved}")
    state = position["loader"]
    loader.load_state_dict({} if state.get(FINISHED) else state)

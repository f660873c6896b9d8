"""DataLoaders under DDP: global -> per-rank batch, samplers, worker hygiene, memory estimate.

``batch_size`` in the config is GLOBAL (across all ranks) and is divided by the
world size. ``num_workers`` and ``prefetch_factor`` are PER RANK.

The training sampler is always a ``DistributedSampler`` (one replica in a
single process), so the data order is a function of (seed, epoch) alone: a run
resumed at epoch k sees exactly the order an uninterrupted run would. In a
loader worker every training sample is loaded with the worker's generators
seeded from (seed, epoch, index) (:class:`SeededDataset`), so its random
augmentations do not depend on which worker loads it (see :mod:`echelon3.data.rng`).
Evaluation shards by stride without padding, so no sample is counted twice.

A dataset that is an ``IterableDataset`` (a *stream*, :mod:`echelon3.data.streams`)
takes no sampler: it is told its rank (``set_shard``) and shards itself over ranks x
loader workers. Its train loader, when the spec is the default
``torch.utils.data.DataLoader``, is torchdata's ``StatefulDataLoader``, whose position
goes into a checkpoint; a loader type of the user's own is kept, without a position.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import signal
import sys
import warnings
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler,
                              get_worker_info)

from echelon3.config.build import instantiate, is_spec, to_plain
from echelon3.config.errors import BatchSizeError, BuildError, ConfigError
from echelon3.data.rng import seed_sample
from echelon3.data.samples import GuardedCollate, GuardedDataset
from echelon3.data.streams import STATEFUL_MODULE, STATEFUL_TYPE, Stream

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def worker_init(_worker_id: int) -> None:
    """Reap this loader worker with its parent process (Linux), so a killed run leaves no orphans."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


class SeededDataset(Dataset):
    """A training set whose samples, in a loader worker, are loaded with the worker's
    generators seeded from (seed, epoch, index). The epoch lives in shared memory, so
    persistent workers see each new one."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, int(seed)
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "seed", "epoch"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index):
        if get_worker_info() is not None:
            seed_sample(self.seed, int(self.epoch), index)
        return self.dataset[index]


class TrainSampler(DistributedSampler):
    """DistributedSampler that can start its next epoch part-way, after ``skip`` samples of
    this rank (a run resumed from a mid-epoch checkpoint). ``len`` stays the whole epoch's.
    ``seeded``: the :class:`SeededDataset` told the epoch."""

    skip = 0
    seeded: SeededDataset | None = None

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self.seeded is not None:
            self.seeded.epoch.fill_(epoch)

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class ShardSampler(Sampler[int]):
    """Rank r takes samples r, r+W, r+2W, ... in order: every sample exactly once overall."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int):
        self.length = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.num_replicas))


def per_rank_batch(global_batch: int, world_size: int, key: str) -> int:
    """``global_batch / world_size``, or a ValueError naming both numbers and nearby valid sizes."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise BatchSizeError(key, f"must be a positive whole number, got {global_batch!r}")
    if global_batch % world_size == 0:
        return global_batch // world_size
    lower = (global_batch // world_size) * world_size
    upper = lower + world_size
    nearest = " or ".join(str(n) for n in (lower, upper) if n > 0)
    raise BatchSizeError(key, f"batch_size {global_batch} is global and must be divisible by the "
                         f"world size {world_size}; use {nearest}")


def check_batch_sizes(loaders_cfg: Mapping, world_size: int) -> None:
    """Validate every loader's global batch size before any worker starts."""
    for name, spec in (loaders_cfg or {}).items():
        batch = ((spec or {}).get("config") or {}).get("batch_size", 1)
        per_rank_batch(batch, world_size, f"dataloaders.{name}.config.batch_size")


def _sample_bytes(sample: Any) -> int:
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.nelement()
    if isinstance(sample, Mapping):
        return sum(_sample_bytes(v) for v in sample.values())
    if isinstance(sample, list | tuple):
        return sum(_sample_bytes(v) for v in sample)
    if hasattr(sample, "nbytes"):
        return int(sample.nbytes)
    return 8


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def report_prefetch(name: str, dataset: Dataset, world_size: int, num_workers: int,
                    prefetch_factor: int, batch: int) -> int:
    """Print (rank 0) how many batches sit in host RAM at once and what they cost (not
    for a stream, whose first sample is not read ahead of time)."""
    batches = world_size * num_workers * prefetch_factor
    if isinstance(dataset, IterableDataset):
        if num_workers:
            log.info("dataloaders.%s: %d ranks x %d workers x prefetch %d = %d batches of %d "
                     "in flight", name, world_size, num_workers, prefetch_factor, batches, batch)
        return 0
    if num_workers == 0 or len(dataset) == 0:
        return 0
    estimate = batches * batch * _sample_bytes(dataset[0])
    log.info("dataloaders.%s: %d ranks x %d workers x prefetch %d = %d batches of %d in flight, "
             "about %.1f MiB of host RAM", name, world_size, num_workers, prefetch_factor,
             batches, batch, estimate / 2**20)
    available = available_memory_bytes()
    if available is not None and estimate > available:
        log.warning("dataloaders.%s: the prefetched batches (%.1f MiB) exceed the available "
                    "memory (%.1f MiB); lower num_workers / prefetch_factor (they are per rank)",
                    name, estimate / 2**20, available / 2**20)
    return estimate


def create_dataloader(name: str, spec: Mapping, dataset: Dataset, *, train: bool, rank: int,
                      world_size: int, seed: int, config_dir=None,
                      data_key: str = "data") -> DataLoader:
    """Build ``dataloaders.<name>`` for this rank, injecting ``dataset=`` and the sampler;
    a bad sample is reported naming ``data_key`` (see :mod:`echelon3.data.samples`)."""
    key = f"dataloaders.{name}"
    if not is_spec(spec):
        spec = {"module": "torch.utils.data", "type": "DataLoader", **(spec or {})}
    config = dict(to_plain(spec.get("config")) or {})
    for injected in ("dataset", "sampler", "batch_sampler"):
        if injected in config:
            raise BuildError(f"{key}.config.{injected}", "is set by echelon3; remove it")
    batch = per_rank_batch(config.get("batch_size", 1), world_size,
                           f"{key}.config.batch_size")
    if isinstance(dataset, IterableDataset) and "shuffle" in config:
        raise ConfigError(f"{key}.config.shuffle", "a stream (IterableDataset) orders its own "
                          "samples (data.*.config); remove it")
    shuffle = bool(config.pop("shuffle", train))
    drop_last = bool(config.pop("drop_last", False))
    dataset, sampler, spec = _sampler_for(dataset, spec, name, train=train, rank=rank,
                                          world_size=world_size, seed=seed, shuffle=shuffle,
                                          drop_last=drop_last, data_key=data_key,
                                          workers=int(config.get("num_workers", 0)))
    config.update(batch_size=batch, drop_last=drop_last if train else False)
    if not isinstance(dataset, IterableDataset):
        dataset = GuardedDataset(dataset, data_key)
        if "collate_fn" not in config:
            config["collate_fn"] = GuardedCollate(None, data_key)
    workers = int(config.get("num_workers", 0))
    if workers > 0:
        config.setdefault("persistent_workers", False)
        config.setdefault("worker_init_fn", worker_init)
        config.setdefault("prefetch_factor", 2)
        if sys.platform.startswith("linux"):
            # A worker spawned by echelon3 inherits the "spawn" start method; loader workers
            # must still fork, as under torchrun, so datasets from config-side .py files work.
            config.setdefault("multiprocessing_context", "fork")
        if rank == 0:
            report_prefetch(name, dataset, world_size, workers, int(config["prefetch_factor"]),
                            batch)
    spec = {"module": spec["module"], "type": spec["type"], "config": config}
    injected = {}
    if "generator" not in config:
        # The loader's own generator draws the workers' base seed (which DataLoader draws
        # even without workers), so opening its batches takes nothing from the training RNG:
        # the same whether the loader is new (a resumed run) or persistent workers carry on
        # (a straight one), and a validation does not change the dropout masks after it.
        injected["generator"] = torch.Generator().manual_seed(int(seed))
    if sampler is not None:
        injected["sampler"] = sampler
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch function
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return instantiate(spec, key, config_dir, dataset=dataset, **injected)


def _sampler_for(dataset: Dataset, spec: Mapping, name: str, *, train: bool, rank: int,
                 world_size: int, seed: int, shuffle: bool, drop_last: bool, data_key: str,
                 workers: int) -> tuple[Dataset, Sampler | None, Mapping]:
    """(dataset, sampler, loader spec): a map-style set gets its sampler (and, to train,
    per-sample seeds); a stream none, and to train a StatefulDataLoader for the default."""
    if isinstance(dataset, IterableDataset):
        _prepare_stream(dataset, name, rank, world_size, seed, workers, data_key)
        if train and (spec["module"], spec["type"]) == ("torch.utils.data", "DataLoader"):
            spec = {**spec, "module": STATEFUL_MODULE, "type": STATEFUL_TYPE}
        return dataset, None, spec
    if not train:
        return dataset, ShardSampler(dataset, world_size, rank), spec
    sampler = TrainSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                           seed=seed, drop_last=drop_last)
    if workers == 0:  # samples load in the training process: nothing to seed per sample
        return dataset, sampler, spec
    sampler.seeded = SeededDataset(dataset, seed)
    return sampler.seeded, sampler, spec


def _prepare_stream(dataset: IterableDataset, name: str, rank: int, world_size: int,
                    seed: int, workers: int, data_key: str) -> None:
    """Tell a stream its rank (and root ``seed`` when it has none of its own); warn when an
    IterableDataset that shards nothing is read by several ranks or workers."""
    if isinstance(dataset, Stream) and dataset.seed is None:
        dataset.seed = int(seed)
    if callable(getattr(dataset, "set_shard", None)):
        dataset.set_shard(rank, world_size)
    elif (world_size > 1 or workers > 0) and rank == 0:
        log.warning("%s is an IterableDataset without set_shard: each of the %d ranks x %d "
                    "workers of dataloaders.%s reads all of it unless it shards itself "
                    "(echelon3.data.streams.shard_info or Stream)", data_key, world_size,
                    max(workers, 1), name)


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """Tell the sampler (map-style) or the stream (IterableDataset) which epoch comes next."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)


def known_length(loader) -> int | None:
    """``len(loader)``, or None for a stream whose length is not known in advance."""
    try:
        return len(loader)
    except TypeError:
        return None


class Limited:
    """A validation loader cut to its first ``limit`` batches (``limit_val_batches``): on
    every rank the first ``limit`` of its shard, so the same samples at every validation
    (the first ``limit`` x global batch ones, at any world size)."""

    def __init__(self, loader, limit: int):
        self.loader, self.limit = loader, limit

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.limit)

    def __len__(self) -> int:
        length = known_length(self.loader)
        return self.limit if length is None else min(length, self.limit)

    def __getattr__(self, name: str):
        if name in ("loader", "limit"):
            raise AttributeError(name)
        return getattr(self.loader, name)


def limit_batches(loaders: Mapping[str, Any], limit: int | None) -> dict[str, Any]:
    """Each loader cut to ``limit`` batches (None: as they are)."""
    return dict(loaders) if limit is None else {k: Limited(v, limit) for k, v in loaders.items()}


def skip_batches(loader: DataLoader, batches: int) -> None:
    """Make the loader's next epoch start after its first ``batches`` batches (map-style
    sets; a stream resumes with :func:`echelon3.data.streams.resume_position`)."""
    if batches <= 0:
        return
    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        raise TypeError("a stream (IterableDataset) cannot skip batches; restore its "
                        "position with echelon3.data.streams.resume_position")
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, TrainSampler):
        raise TypeError("only a train loader built by echelon3 can start part-way")
    sampler.skip = batches * int(loader.batch_size)


def create_dataloaders(loaders_cfg: Mapping, train_set: Dataset | None,
                       test_sets: Mapping[str, Dataset], *, rank: int = 0, world_size: int = 1,
                       seed: int = 0, config_dir=None,
                       data_keys: Mapping[str, str] | None = None) -> tuple[
                           DataLoader | None, dict[str, DataLoader]]:
    """The train loader and one loader per test set (``dataloaders.test`` unless a loader
    is configured under the test set's own name). ``data_keys``: the config key of a test
    set, when not ``data.test`` / ``data.test.<name>``."""
    loaders_cfg = loaders_cfg or {}
    common = dict(rank=rank, world_size=world_size, seed=seed, config_dir=config_dir)
    train = None
    if train_set is not None:
        if "train" not in loaders_cfg:
            raise BuildError("dataloaders.train", "required section missing")
        train = create_dataloader("train", loaders_cfg["train"], train_set, train=True,
                                  data_key="data.train", **common)
    tests = {}
    for name, dataset in test_sets.items():
        key = name if name in loaders_cfg else "test"
        if key not in loaders_cfg:
            raise BuildError("dataloaders.test", f"required to load test set '{name}'")
        data_key = (data_keys or {}).get(name) or ("data.test" if name == "test"
                                                   else f"data.test.{name}")
        tests[name] = create_dataloader(key, loaders_cfg[key], dataset, train=False,
                                        data_key=data_key, **common)
    return train, tests

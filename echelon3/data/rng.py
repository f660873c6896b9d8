"""Random number generators: seeding, their state as checkpoint data, and per-sample seeds.

A run is a function of root ``seed``. The training process's generators
(Python, NumPy, torch, CUDA) are saved in every checkpoint and restored on
resume, so dropout masks and in-process augmentations continue exactly.

Loader workers are other processes whose generators are not checkpointed;
which worker draws which batch also changes when an epoch resumes part-way.
So, in a loader worker, echelon3 seeds the worker's generators before every
sample from ``(seed, epoch, index)`` (:func:`seed_sample`): a dataset that
draws random numbers in ``__getitem__`` (``torch.rand``, ``np.random``,
``random``) gets the same numbers for the same sample in the same epoch,
whichever worker loads it, whether the epoch was resumed, and with
``persistent_workers``. In the training process itself (``num_workers: 0``)
nothing is reseeded: the checkpointed state continues.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

_MASK = 2**63 - 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch (a fixed integer hash; no Python hash())."""
    value = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch)) & _MASK
    value = (value * 0xBF58476D1CE4E5B9 + int(index)) & _MASK
    value ^= value >> 31
    return (value * 0x94D049BB133111EB) & _MASK


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed this process's generators for one sample (called in loader workers only)."""
    value = sample_seed(seed, epoch, index)
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


def rng_state() -> dict[str, Any]:
    """This process's generator states as checkpoint data (tensors and plain types)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)],
        "python": [version, list(internal), gauss_next],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def restore_for_rank(saved: list | None, fallback: dict[str, Any], rank: int,
                     world_size: int) -> None:
    """Restore this rank's saved state; after a world-size change, where there is none
    to take, derive a distinct stream per rank from rank 0's (not the same masks on all)."""
    if saved is not None and len(saved) == world_size:
        set_rng_state(saved[rank])
        return
    set_rng_state(fallback)
    if world_size > 1 or saved is not None:
        base = int(torch.randint(0, 2**62, (1,)).item())
        seed_everything(base + rank)

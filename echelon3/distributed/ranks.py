"""Rank helpers: who this process is in the job, and the few collectives echelon3 uses.

Every helper is a safe no-op in a single process (no process group), so code that
calls them runs the same at one rank and at N.
"""

from __future__ import annotations

import os
from typing import Any


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank in the job: 0 in a single process."""
    if _initialized():
        import torch.distributed as dist

        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    """Number of processes in the job: 1 in a single process."""
    if _initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    """True on rank 0, the rank that prints, logs and writes files."""
    return get_rank() == 0


def barrier() -> None:
    """Wait until every rank gets here; a no-op in a single process."""
    if _initialized():
        import torch.distributed as dist

        dist.barrier()


def all_reduce_sum_(*tensors) -> None:
    """Sum each tensor in place across ranks; a no-op in a single process."""
    if _initialized():
        import torch.distributed as dist

        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)


def all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` in a single process)."""
    if not _initialized():
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def unwrap(model):
    """The plain network under DDP and ``torch.compile`` wrappers."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def broadcast_buffers_(*modules, tensors=()) -> None:
    """Every buffer of ``modules`` (BatchNorm's running statistics, ...), and ``tensors``,
    set to rank 0's in place; a no-op in a single process. Rank 0's buffers are the
    model's: what each rank validates with and what a checkpoint holds, as DDP makes them
    before each forward."""
    if not _initialized():
        return
    import torch.distributed as dist

    for buffer in [*(b for module in modules for b in module.buffers()), *tensors]:
        dist.broadcast(buffer.data, src=0)

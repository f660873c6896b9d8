"""Consolidation: a sharded network's weights as whole tensors on rank 0's CPU.

What ``best.tar`` holds under ``strategy: fsdp`` (one unprefixed file, like DDP's), and what
a consolidated export reads.
"""

from __future__ import annotations

import torch

from echelon3.distributed.ranks import get_rank


def consolidated(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors on rank 0's CPU, gathered one at a time (a collective when sharded);
    ``{}`` on the other ranks."""
    full = {}
    for key, value in weights.items():
        if hasattr(value, "full_tensor"):
            if value.device.type == "cpu" and torch.distributed.get_backend() == "nccl":
                value = value.cuda()  # offloaded: gathered over NCCL, one tensor at a time
            whole = value.full_tensor()
        else:
            whole = value
        if get_rank() == 0:
            full[key] = whole.detach().cpu()
        del whole
    return full

"""A checkpoint file's optimizer state laid out for a sharded network.

A ``.tar`` checkpoint (written under DDP, or by one process) holds each parameter's
optimizer state at full size; continuing it under ``strategy: fsdp`` needs every such
tensor cut like the sharded parameter it belongs to.
"""

from __future__ import annotations

from typing import Any

import torch

OPTIMIZER = "optimizer_state_dict"


def lay_out_optimizer(state: dict[str, Any], model, optimizer) -> None:
    """A file's optimizer state (full size) laid out as the sharded parameters."""
    from echelon3.distributed.fsdp import like, sharded_module

    if sharded_module(model) is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, saved in state[OPTIMIZER]["state"].items():
        param = params[int(index)]
        for key, value in saved.items():
            if torch.is_tensor(value) and value.shape == param.shape and value.dim():
                saved[key] = like(param, value.to(param.device))

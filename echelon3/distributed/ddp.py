"""Wrapping the network for training: torch.compile, then DDP with the levers of trainer.config.

- ``ddp_find_unused_parameters`` (default true): DDP searches the graph for
  parameters that got no gradient. Frozen parameters (``requires_grad=False``)
  are never registered with DDP, so they are outside that search.
- ``ddp_gradient_as_bucket_view`` (default true): gradients are views into
  DDP's all-reduce buckets, which saves one copy and the memory of it.
- ``ddp_static_graph`` (default false): the graph is the same every step, so
  DDP can skip the unused-parameter search after the first iteration.
- ``ddp_comm``: ``none`` (default) | ``bf16`` | ``fp16``: PyTorch's gradient
  compression comm hook; gradients travel in half precision and are cast back.
  DDP accepts ``bf16`` only with NCCL 2.10+ (CUDA) or XCCL; under gloo (CPU)
  it is refused with a message naming the key, and ``fp16`` works.

When a profiler window is configured, the all-reduce is wrapped in a
``record_function("all_reduce")`` label so the trace shows it apart from compute.
"""

from __future__ import annotations

import functools
import logging

import torch

from echelon3.config.errors import ConfigError

DDP_KEYS = {"ddp_find_unused_parameters": True, "ddp_comm": "none",
            "ddp_gradient_as_bucket_view": True, "ddp_static_graph": False}
COMM = ("none", "bf16", "fp16")
log = logging.getLogger(__name__)


def check_settings(settings: dict) -> None:
    """The DDP keys of ``trainer.config``, checked before anything starts."""
    for key in ("ddp_find_unused_parameters", "ddp_gradient_as_bucket_view", "ddp_static_graph"):
        if not isinstance(settings[key], bool):
            raise ConfigError(f"trainer.config.{key}", f"must be true or false, got "
                              f"{settings[key]!r}")
    if settings["ddp_comm"] not in COMM:
        raise ConfigError("trainer.config.ddp_comm", f"must be one of {', '.join(COMM)}, got "
                          f"{settings['ddp_comm']!r}")


def comm_hook(name: str, label: bool = False):
    """The comm hook for ``ddp_comm: name``; None for DDP's built-in all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook,
            "none": default_hooks.allreduce_hook if label else None}[name]
    if hook is None or not label:
        return hook

    @functools.wraps(hook)
    def labelled(state, bucket):
        with torch.profiler.record_function("all_reduce"):
            return hook(state, bucket)

    return labelled


def wrap(net, device, world_size: int, settings: dict, label_allreduce: bool = False):
    """torch.compile first, then DDP (checkpoints strip both prefixes)."""
    model = net
    if settings["compile"]:
        model = torch.compile(model, mode=settings["compile_mode"])
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=settings["ddp_find_unused_parameters"],
            gradient_as_bucket_view=settings["ddp_gradient_as_bucket_view"],
            static_graph=settings["ddp_static_graph"])
        hook = comm_hook(settings["ddp_comm"], label_allreduce)
        if hook is not None:
            try:
                model.register_comm_hook(None, hook)
            except (TypeError, RuntimeError) as e:  # bf16: DDP accepts it on NCCL/XCCL only
                raise ConfigError("trainer.config.ddp_comm", f"{settings['ddp_comm']} is not "
                                  f"supported here: {str(e).splitlines()[0]}; use fp16 or "
                                  "none") from e
    return model


def hint_unused_search(model) -> bool:
    """Say when DDP's unused-parameter search (the default) found nothing: it then costs a
    traversal of the autograd graph every step for no use (about a quarter of the ranks'
    CPU on a small network: benchmarks/parity.py). True once that is decided: DDP's
    figures are there from the forward after its first backward."""
    from torch.nn.parallel import DistributedDataParallel

    from echelon3.distributed.ranks import is_main

    if not isinstance(model, DistributedDataParallel) or not model.find_unused_parameters:
        return True
    try:
        unused = model._get_ddp_logging_data().get("unused_parameter_size")
    except (AttributeError, RuntimeError):  # a private API: say nothing rather than guess
        return True
    if unused is None:
        return False
    if unused == 0 and is_main():
        log.warning("DDP found no unused parameter: trainer.config."
                    "ddp_find_unused_parameters: false saves its search of the autograd "
                    "graph every step (keep true if a branch can skip parameters)")
    return True

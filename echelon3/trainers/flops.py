"""The FLOPs of one micro-batch's forward and backward, counted once, leaving no trace.

``trainer.config.flops_per_step: count`` makes the trainer call :func:`micro_batch_flops`
on its first micro-batch. :class:`torch.utils.flop_counter.FlopCounterMode` counts the
matrix multiplies and convolutions of the forward and the backward (the gradients of
the trainable parameters, through ``torch.autograd.grad``). Nothing of the training
moves: the gradients are returned, not accumulated (so DDP's hooks do not fire), the
random number generators are forked (dropout draws the same masks afterwards) and the
buffers (BatchNorm's running statistics, its batch count) are put back as they were.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode

from echelon3.data.batches import call_net, split_batch, to_device, weighted_loss
from echelon3.distributed.ranks import unwrap


@contextlib.contextmanager
def buffers_kept(module: torch.nn.Module):
    """Every buffer of ``module`` as it was on entry, again on exit."""
    kept = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def micro_batch_flops(net, losses, batch, precision, params, device,
                      float_labels: bool = False) -> int:
    """FLOPs of ``batch``'s forward (under ``precision``'s autocast), loss and backward on
    the plain network under ``net``'s wrappers; the training state is left untouched."""
    module = unwrap(net)
    inputs, target = split_batch(batch)
    inputs, target = to_device((inputs, target), device)
    cuda = [torch.device(device)] if torch.device(device).type == "cuda" else []
    trainable = [p for p in params if p.requires_grad]
    with torch.random.fork_rng(devices=cuda), buffers_kept(module), \
            FlopCounterMode(display=False) as counter:
        with precision.autocast():
            out = call_net(module, module, losses, inputs, target)
            total, _ = weighted_loss(losses, out, target, float_labels)
        torch.autograd.grad(total, trainable, allow_unused=True)
    return int(counter.get_total_flops())

"""An exponential moving average of the weights: ``trainer.config.ema``.

``{decay, every_n_steps: 1, warmup_steps: 0}``. After an optimizer step whose
``global_step`` is a multiple of ``every_n_steps``, the average moves toward
the weights: ``ema = decay * ema + (1 - decay) * weights``, buffers (batch-norm
statistics) included. Until ``warmup_steps`` optimizer steps are done the
average is the weights themselves (copied), so it does not start from the
untrained network. Skipped windows (``nan_policy: skip``) change no weight and
update nothing.

With EMA on, validation, keep-best and ``best.tar`` use the averaged weights,
so ``evaluate``, ``run``, ``export`` and ``finetune`` see them; epoch and
preemption checkpoints keep the training weights and the average both (the average
as ``model_state_dict``, the training weights as ``training_model_state_dict``), so a
resumed run continues the same average. An fp16 step the GradScaler skipped (an
overflow) changed no weight, and the average still moves towards them, as Lightning's
and timm's do: the step counts for ``every_n_steps`` and ``warmup_steps`` alike.
The update is one ``torch._foreach_lerp_`` over the floating-point tensors, as
in :func:`torch.optim.swa_utils.get_ema_multi_avg_fn`, without
``AveragedModel``'s read of its step counter, which would wait for the GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from echelon3.config.errors import ConfigError

KEY = "trainer.config.ema"
SETTINGS = ("decay", "every_n_steps", "warmup_steps")


def _setting(config: Mapping, name: str, default, kind):
    value = config.get(name, default)
    if not isinstance(value, kind) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{KEY}.{name}", f"must be a non-negative number, got {value!r}")
    return value


class EMA:
    """The average of ``net``'s parameters and buffers, tensor by tensor, kept beside them
    (under ``strategy: fsdp`` each rank averages its own shards: no whole copy anywhere)."""

    def __init__(self, net: torch.nn.Module, config: Mapping[str, Any]):
        if not isinstance(config, Mapping):
            raise ConfigError(KEY, "must be a mapping {decay, every_n_steps, warmup_steps}")
        for name in config:
            if name not in SETTINGS:
                raise ConfigError(f"{KEY}.{name}", f"unknown key; ema takes "
                                  f"{', '.join(SETTINGS)}")
        if "decay" not in config:
            raise ConfigError(f"{KEY}.decay", "is required (e.g. 0.999)")
        self.decay = float(_setting(config, "decay", None, int | float))
        if not 0 < self.decay < 1:
            raise ConfigError(f"{KEY}.decay", f"must lie between 0 and 1, got {self.decay}")
        self.every = int(_setting(config, "every_n_steps", 1, int)) or 1
        self.warmup = int(_setting(config, "warmup_steps", 0, int))
        self.net = net
        live = net.state_dict(keep_vars=True)  # parameters and buffers, by name
        self.average = {name: t.detach().clone() for name, t in live.items()}
        buffers = {name for name, _ in net.named_buffers()}
        # in the state's order, which every rank shares (they are broadcast in it)
        self._buffers = [t for name, t in self.average.items() if name in buffers]
        # The pairs (average, weights) are set once, as local tensors (a DTensor's shard):
        # the weights are updated in place.
        pairs = [(_local(self.average[name]), _local(t.detach())) for name, t in live.items()]
        self._all = [list(side) for side in zip(*pairs)]
        self._floats = [list(side) for side in zip(*(p for p in pairs if p[0].is_floating_point()))]
        self._counters = [p for p in pairs if not p[0].is_floating_point()]

    def update(self, global_step: int) -> None:
        """After optimizer step ``global_step`` (1-based)."""
        if global_step % self.every:
            return
        if global_step <= self.warmup:
            torch._foreach_copy_(*self._all)
            return
        if self._floats:
            torch._foreach_lerp_(*self._floats, 1 - self.decay)
        for mine, theirs in self._counters:
            mine.copy_(theirs)  # step counters of batch norm: taken as they are

    def buffers(self) -> list[torch.Tensor]:
        """The averaged buffers (rank 0's become every rank's before a checkpoint)."""
        return list(self._buffers)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[torch.nn.Module]:
        """The network holding the average (to validate it); its own weights are back after.
        Under FSDP the shards are swapped, each rank its own."""
        from echelon3.distributed.fsdp import sharded_units

        for unit in sharded_units(self.net):
            unit.reshard()  # a gathered copy would hide the swap
        averages, weights = self._all
        kept = [w.clone() for w in weights]
        torch._foreach_copy_(weights, averages)
        try:
            yield self.net
        finally:
            for unit in sharded_units(self.net):
                unit.reshard()
            torch._foreach_copy_(weights, kept)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.average)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from echelon3.distributed.fsdp import like

        missing = [name for name in self.average if name not in state]
        if missing:
            raise KeyError(f"the average has no {missing[0]}")
        for name, mine in self.average.items():
            value = state[name].to(mine.device)
            if hasattr(mine, "to_local") and not hasattr(value, "to_local"):
                value = like(mine, value)  # a whole tensor (a file) cut like the shard
            _local(mine).copy_(_local(value))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor

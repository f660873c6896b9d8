"""Sharded data parallel (FSDP2) and activation checkpointing: the root keys and the wrapping.

Root ``strategy: ddp | fsdp`` (default ``ddp``). Under ``fsdp`` every rank holds
1/N of the parameters, gradients and optimizer state (``fully_shard``: parameters
are DTensors sharded on dim 0); a shard unit gathers its parameters for its
forward and backward and frees them after. Its settings, under root ``fsdp:``::

    fsdp:
      units: [Block]               # module classes that become their own shard unit:
                                   # names or regexes of type(module).__name__
      reshard_after_forward: true  # free a unit's gathered parameters after its forward
                                   # (gathered again for backward): less memory, more traffic
      offload: false               # parameters, gradients and optimizer state live on the
                                   # CPU (needs a GPU: the step runs on the CPU)

The root module is always a unit too, for what no named unit holds. The
mixed-precision policy follows ``trainer.config.precision``: ``bf16`` computes
with bf16 copies of the parameters and reduces gradients in fp32 (the sharded
parameters and the optimizer stay fp32); ``fp32`` casts nothing; ``fp16`` is
refused (its GradScaler would have to unscale sharded gradients; bf16 needs no
scaling). With one process nothing is sharded, as DDP wraps nothing.

Accumulation (``grad_accum_steps``) skips the reduce-scatter inside a window
(``set_requires_gradient_sync(False)``, FSDP's ``no_sync``); a preemption under
several ranks stops at a window's end, so an open window is never saved sharded.
``compile`` compiles the sharded network. ``trainer.config.ddp_comm`` is refused.
Buffers (BatchNorm's running statistics) are not sharded; as under DDP, every forward
starts from rank 0's, so every rank validates and saves the same ones.

Root ``activation_checkpointing: [Block]`` (the same spelling as ``fsdp.units``)
recomputes the named modules' activations in backward instead of keeping them,
under either strategy (``torch.distributed._composable.checkpoint``: parameter
names do not change, so checkpoints are the same).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

from echelon3.config.errors import ConfigError
from echelon3.distributed.ranks import broadcast_buffers_

STRATEGIES = ("ddp", "fsdp")
FSDP_KEYS = {"units": [], "reshard_after_forward": True, "offload": False}


def strategy(cfg) -> str:
    name = cfg.get("strategy") or "ddp"
    if name not in STRATEGIES:
        raise ConfigError("strategy", f"must be one of {', '.join(STRATEGIES)}, got {name!r}")
    return name


def _patterns(value: Any, key: str) -> list[re.Pattern]:
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"must be a list of class names or regexes, got {value!r}")
    try:
        return [re.compile(v) for v in value]
    except re.error as e:
        raise ConfigError(key, f"not a regex: {e}") from e


def fsdp_settings(cfg) -> dict[str, Any]:
    """The ``fsdp:`` section with its defaults, checked."""
    given = dict(cfg.get("fsdp") or {})
    unknown = sorted(set(given) - set(FSDP_KEYS))
    if unknown:
        raise ConfigError(f"fsdp.{unknown[0]}", f"unknown key; known: {', '.join(FSDP_KEYS)}")
    settings = {**FSDP_KEYS, **given}
    for key in ("reshard_after_forward", "offload"):
        if not isinstance(settings[key], bool):
            raise ConfigError(f"fsdp.{key}", f"must be true or false, got {settings[key]!r}")
    settings["units"] = _patterns(settings["units"], "fsdp.units")
    return settings


def matching(net: torch.nn.Module, patterns: list[re.Pattern], key: str) -> list:
    """Submodules (not the root) whose class name matches a pattern, innermost first;
    a pattern that matches nothing is an error naming ``key``."""
    found, used = [], set()
    for _, module in list(net.named_modules())[1:]:
        hits = {p.pattern for p in patterns if p.fullmatch(type(module).__name__)}
        if hits:
            found.append(module)
            used |= hits
    missing = [p.pattern for p in patterns if p.pattern not in used]
    if missing:
        classes = sorted({type(m).__name__ for m in net.modules()})
        raise ConfigError(key, f"{missing[0]!r} matches no module of the network (its classes: "
                          f"{', '.join(classes)})")
    return found[::-1]


def checkpoint_activations(cfg, net: torch.nn.Module) -> int:
    """Root ``activation_checkpointing``: recompute the named modules in backward; how many."""
    modules = matching(net, _patterns(cfg.get("activation_checkpointing"),
                                      "activation_checkpointing"), "activation_checkpointing")
    if modules:
        from torch.distributed._composable import checkpoint

        for module in modules:
            checkpoint(module)
    return len(modules)


def mp_policy(mode: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mode == "fp16":
        raise ConfigError("trainer.config.precision", "fp16 is not supported with strategy "
                          "fsdp (a GradScaler cannot unscale sharded gradients); use bf16 "
                          "(no loss scaling needed) or fp32")
    if mode == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def check_runtime(settings: dict, fsdp: dict, device) -> None:
    """What FSDP refuses of ``trainer.config`` and ``fsdp``, before anything starts
    (at any world size, so that a config that runs in one process runs on N)."""
    from echelon3.distributed.precision import resolve_mode

    mp_policy(resolve_mode(settings["precision"], torch.device(device)))
    if settings["ddp_comm"] != "none":
        raise ConfigError("trainer.config.ddp_comm", "is a DDP comm hook; with strategy fsdp "
                          "use the bf16 mixed-precision policy (trainer.config.precision: bf16)")
    if fsdp["offload"] and torch.device(device).type == "cpu":
        raise ConfigError("fsdp.offload", "needs a GPU: on the CPU the state is already there")


def shard(net: torch.nn.Module, device, world_size: int, fsdp: dict, mode: str):
    """``fully_shard`` every named unit, innermost first, then the root; the root returned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    device = torch.device(device)
    options = {"mesh": init_device_mesh(device.type, (world_size,)),
               "reshard_after_forward": fsdp["reshard_after_forward"],
               "mp_policy": mp_policy(mode)}
    if fsdp["offload"]:
        options["offload_policy"] = CPUOffloadPolicy()
    for module in matching(net, fsdp["units"], "fsdp.units"):
        fully_shard(module, **options)
    root = fully_shard(net, **options)
    if any(True for _ in root.buffers()):
        # FSDP keeps each rank's buffers; as DDP does, every forward starts from rank 0's
        root.register_forward_pre_hook(lambda module, args: broadcast_buffers_(module))
    return root


def sharded_module(net):
    """The FSDP root under a ``torch.compile`` wrapper, or None when ``net`` is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    net = getattr(net, "_orig_mod", net)
    return net if isinstance(net, FSDPModule) else None


def sharded_units(net) -> list:
    """Every FSDP unit of ``net`` (none when it is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    net = getattr(net, "_orig_mod", net)
    return [m for m in net.modules() if isinstance(m, FSDPModule)]


def no_sync(net):
    """FSDP's ``no_sync``: gradients accumulate unreduced until the context exits, and the
    next backward (the window's last) reduce-scatters them all."""
    module = sharded_module(net)

    @contextlib.contextmanager
    def skipping():
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    return skipping()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``param`` (sharded when it is a DTensor)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, param.device_mesh, param.placements)
    return full


class Lockstep:
    """A validation loader under FSDP. Exact validation gives ranks shards of different
    lengths, but a sharded forward is a collective: a rank that ran out of batches runs
    forwards of a spare sample (counted nowhere) until every rank has run as many."""

    def __init__(self, loader, net, precision, device, most: int):
        self.loader, self.net, self.precision, self.device = loader, net, precision, device
        self.most = most

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def __iter__(self):
        done = 0
        for batch in self.loader:
            done += 1
            yield batch
        if done < self.most:
            from echelon3.data.batches import split_batch, to_device

            spare = self.loader.collate_fn([self.loader.dataset[0]])
            inputs = to_device(split_batch(spare)[0], self.device)
            with torch.no_grad(), self.precision.autocast():
                for _ in range(self.most - done):
                    self.net(inputs)


def lockstep(loaders: dict, net, precision, device) -> dict:
    """Every validation loader as a :class:`Lockstep` (a collective: lengths are exchanged)."""
    from echelon3.distributed.ranks import all_gather_object

    lengths = all_gather_object({name: len(loader) for name, loader in loaders.items()})
    return {name: Lockstep(loader, net, precision, device, max(r[name] for r in lengths))
            for name, loader in loaders.items()}


class Strategy:
    """Root ``strategy``, ``fsdp`` and ``activation_checkpointing`` for a training run."""

    def __init__(self, cfg, settings: dict, device):
        self.cfg, self.name = cfg, strategy(cfg)
        self.fsdp = fsdp_settings(cfg) if self.name == "fsdp" else None
        if self.fsdp is not None:
            check_runtime(settings, self.fsdp, device)

    @property
    def sharded(self) -> bool:
        return self.fsdp is not None

    def prepare(self, net, params, device, world_size: int, settings: dict):
        """Before the optimizer is built: activation checkpointing, then (FSDP, several
        ranks) sharding; ``params`` (a list, or a list of groups) as the sharded parameters."""
        checkpoint_activations(self.cfg, net)
        if self.fsdp is not None:
            matching(net, self.fsdp["units"], "fsdp.units")  # checked in one process too
        if self.fsdp is None or world_size < 2:
            return params
        from echelon3.distributed.precision import resolve_mode

        names = {id(p): name for name, p in net.named_parameters()}
        shard(net, device, world_size, self.fsdp, resolve_mode(settings["precision"], device))
        now = dict(net.named_parameters())
        if params and isinstance(params[0], dict):
            return [{**group, "params": [now[names[id(p)]] for p in group["params"]]}
                    for group in params]
        return [now[names[id(p)]] for p in params]

    def wrap(self, net, device, world_size: int, settings: dict, label: bool):
        """After: DDP (:func:`echelon3.distributed.ddp.wrap`), or ``torch.compile`` of the
        sharded net."""
        from echelon3.distributed import ddp

        if self.fsdp is None:
            return ddp.wrap(net, device, world_size, settings, label_allreduce=label)
        return torch.compile(net, mode=settings["compile_mode"]) if settings["compile"] else net

"""What a batch is: split into inputs and target, moved to the device, scored by the losses.

Shared by the trainer, validation, ``evaluate``, ``run`` and ``export``.

A network may return a mapping of outputs (``{"cls": logits, "aux": value}``) and a
batch's target may be a mapping too. A loss or metric configured with ``input_key``
/ ``target_key`` reads that entry (:class:`Keyed`); one configured without them
receives the whole mapping. Under ``loss: from_output`` the network computes its own
loss from the target it is handed (:class:`OutputLoss`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping, Sequence

import torch

from echelon3.config.errors import ConfigError, UserError, blame


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, list | tuple) and len(batch) == 2:  # the common case, checked fast
        return batch[0], batch[1]
    if isinstance(batch, Sequence) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and {"input", "target"} <= set(batch):
        return batch["input"], batch["target"]
    raise TypeError("a batch must be (input, target) or a mapping with 'input' and 'target'")


def to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value


def loss_on_device(fn: Any, device) -> Any:
    """A module (a loss with a ``weight`` buffer) moved to ``device``; the tensor arguments
    of a function bound with ``partial: true`` too; anything else as it is."""
    if device is None:
        return fn
    if hasattr(fn, "to"):
        return fn.to(device)
    if isinstance(fn, functools.partial) and any(
            isinstance(v, torch.Tensor) for v in fn.keywords.values()):
        return functools.partial(fn.func, *fn.args, **{
            k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in fn.keywords.items()})
    return fn


def batch_size(target: Any) -> int:
    """The number of samples: the length of the target, or of a mapping's first entry."""
    if isinstance(target, Mapping):
        return batch_size(next(iter(target.values())))
    return len(target)


def to_float(value: Any) -> Any:
    """Every tensor in ``value`` as float32 (labels that a loss wants as floats)."""
    if isinstance(value, torch.Tensor):
        return value.float()
    if isinstance(value, Mapping):
        return {k: to_float(v) for k, v in value.items()}
    return value


def match_target(pred: Any, target: Any, float_labels: bool = False):
    """Squeeze trailing singleton dims of ``pred`` down to ``target``'s rank (both
    tensors; mappings are left to :class:`Keyed`)."""
    if isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor):
        while pred.dim() > target.dim() and pred.shape[-1] == 1:
            pred = pred.squeeze(-1)
    return pred, (to_float(target) if float_labels else target)


def pick(value: Any, key: str | None, config_key: str, what: str) -> Any:
    """``value[key]`` (``key`` None: ``value``), or an error naming ``config_key``."""
    if key is None:
        return value
    if not isinstance(value, Mapping):
        raise UserError(config_key, f"is '{key}', but the {what} is a "
                        f"{type(value).__name__}, not a mapping of named entries")
    if key not in value:
        raise UserError(config_key, f"'{key}' is not among the {what}'s keys "
                        f"({', '.join(map(str, value))})")
    return value[key]


class Keyed:
    """``fn`` fed the ``input_key`` entry of the network's output and the ``target_key``
    entry of the target (either may be None: the whole value); ``key`` is its config path."""

    def __init__(self, fn, input_key: str | None, target_key: str | None, key: str):
        for name, value in (("input_key", input_key), ("target_key", target_key)):
            if value is not None and not isinstance(value, str):
                raise UserError(f"{key}.{name}", f"must be a string, got {value!r}")
        self.fn, self.input_key, self.target_key, self.key = fn, input_key, target_key, key

    def select(self, pred: Any, target: Any) -> tuple[Any, Any]:
        return match_target(pick(pred, self.input_key, f"{self.key}.input_key", "network output"),
                            pick(target, self.target_key, f"{self.key}.target_key", "target"))

    def __call__(self, pred: Any, target: Any):
        return self.fn(*self.select(pred, target))

    def __repr__(self) -> str:
        return f"Keyed({self.fn!r}, input_key={self.input_key!r}, target_key={self.target_key!r})"


def mapping_error(key: str, pred: Any, fn: Any, error: Exception) -> UserError | None:
    """For a loss or metric without ``input_key`` that failed on a mapping output: the
    error saying which key to set (None when that is not what happened)."""
    if not isinstance(error, TypeError | AttributeError) or not isinstance(pred, Mapping) \
            or isinstance(fn, Keyed) or getattr(fn, "input_key", None) is not None:
        return None
    return UserError(f"{key}.input_key", f"the network returns a mapping (keys "
                     f"{', '.join(map(str, pred))}) that {key} cannot take "
                     f"({type(error).__name__}: {error}); name the output it reads with "
                     "input_key")


def raise_named(key: str, pred: Any, fn: Any, error: Exception):
    """Raise what ``fn`` (the loss or metric at ``key``) raised: as the ``input_key`` hint
    when a mapping output was the cause, else marked with ``key`` (its one closing line)."""
    named = mapping_error(key, pred, fn, error)
    if named is not None:
        raise named from error
    blame(error, key)
    raise error


def weighted_loss(losses: Mapping, pred, target, float_labels: bool = False):
    """Σ weight · loss(pred, target) -> (total, {name: part}); under ``loss: from_output``
    the loss in the network's output ``pred`` (:class:`OutputLoss`), no parts."""
    if isinstance(losses, OutputLoss):
        return OutputLoss.loss(pred), {}
    pred, target = match_target(pred, target, float_labels)
    parts, total = {}, None
    for name, (fn, weight) in losses.items():
        try:
            parts[name] = part = fn(pred, target)
        except Exception as e:
            raise_named(f"loss.{name}", pred, fn, e)
        term = part if weight == 1 else weight * part  # no extra kernel for weight 1
        total = term if total is None else total + term
    return total, parts


FROM_OUTPUT = "from_output"  # root ``loss: from_output``: the network computes its own loss


class OutputLoss(dict):
    """``loss: from_output``: the network is called with the target and returns its loss.

    How the target is handed over is decided once, from the signature of the plain
    network's ``forward`` (:func:`target_keyword`): ``labels=`` when ``forward`` has a
    parameter of that name (transformers' models), else positionally, ``net(inputs,
    target)``. The output is read by :meth:`loss` and :meth:`logits`:

    - a tensor: the loss (no logits: metrics cannot run);
    - a ``(logits, loss)`` tuple or list;
    - a mapping, or an object with attributes (transformers' ``ModelOutput``): the
      entries ``loss`` and ``logits``.

    It has no named parts (the history holds ``loss`` only) and is true, as a configured
    loss section is.
    """

    def __init__(self):
        super().__init__()
        self.keyword: str | None = None
        self.bound = False

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"OutputLoss(keyword={self.keyword!r})" if self.bound else "OutputLoss()"

    def bind(self, module) -> None:
        """Decide, once, how ``module`` takes the target (the plain network, not a wrapper)."""
        if not self.bound:
            self.keyword = target_keyword(inspect.signature(module.forward),
                                          type(module).__name__)
            self.bound = True

    def call(self, net, module, inputs, target):
        """``net(inputs, target)`` or ``net(inputs, labels=target)``: through ``net`` (the
        DDP or FSDP wrapper, so gradients sync), decided on ``module``."""
        self.bind(module)
        if self.keyword is None:
            return net(inputs, target)
        return net(inputs, **{self.keyword: target})

    @staticmethod
    def loss(out: Any) -> torch.Tensor:
        """The loss in the network's output."""
        value = _entry(out, "loss", 1)
        if not isinstance(value, torch.Tensor):
            raise UserError("loss", f"is {FROM_OUTPUT}, but the network returned "
                            f"{_shape(out)} without a loss tensor (a tensor, (logits, loss), "
                            "or a mapping / object with 'loss')")
        return value

    @staticmethod
    def logits(out: Any) -> Any:
        """The logits in the network's output (what the metrics see), None when absent."""
        return _entry(out, "logits", 0)


def _entry(out: Any, name: str, position: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out if name == "loss" else None
    if isinstance(out, Mapping):
        return out.get(name)
    if isinstance(out, list | tuple) and len(out) == 2:
        return out[position]
    return getattr(out, name, None)


def _shape(out: Any) -> str:
    if isinstance(out, Mapping):
        return f"a mapping (keys {', '.join(map(str, out)) or 'none'})"
    return f"a {type(out).__name__}"


def target_keyword(signature, owner: str) -> str | None:
    """``labels`` when ``forward`` (its ``inspect.Signature``, without ``self``) has that
    parameter, None (positional) when it takes a second positional argument; else the
    :class:`ConfigError` of ``loss``."""
    params = list(signature.parameters.values())
    if any(p.name == "labels" for p in params[1:]):
        return "labels"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    raise ConfigError("loss", f"is {FROM_OUTPUT}, but {owner}.forward"
                      f"{signature} takes no target: give forward a second "
                      "argument (forward(x, target)) or a labels= parameter, or list the losses")


def call_net(net, module, losses: Mapping | None, inputs, target):
    """The network's output on ``inputs``: with the target too under ``loss: from_output``
    (``module``: the plain network under ``net``'s wrappers)."""
    if isinstance(losses, OutputLoss):
        return losses.call(net, module, inputs, target)
    return net(inputs)


def predictions(losses: Mapping | None, out: Any) -> Any:
    """What the metrics see: the logits under ``loss: from_output``, else the output."""
    if not isinstance(losses, OutputLoss):
        return out
    logits = OutputLoss.logits(out)
    if logits is None:
        raise UserError("loss", f"is {FROM_OUTPUT} and the network returned {_shape(out)} "
                        "without logits, which the metrics need; return (logits, loss) or "
                        "list no metrics")
    return logits

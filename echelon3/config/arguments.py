"""Checking a component's keyword arguments against its signature before calling it.

Names: an unknown keyword gets a "did you mean" and the list of accepted ones;
a missing required one is named. Types: a value is compared with the
parameter's annotation (``epochs: int``, ``lr: Union[float, Tensor]``,
``average: Literal["micro", "macro"]``), or with the type of its default when
it has none, so ``trainer.config.epochs=abc`` reads
``trainer.config.epochs: expected an integer or null, got 'abc'`` instead of whatever
the constructor raises once data and model are built. Annotations this module
cannot judge (type variables, protocols, unresolvable names) accept anything.
"""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from typing import Any, Callable, Mapping

from echelon3.config.errors import BuildError, did_you_mean

_UNKNOWN = None  # "this annotation says nothing checkable"
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          type(None): "null", list: "a list", tuple: "a list", dict: "a mapping",
          collections.abc.Sequence: "a list", collections.abc.Mapping: "a mapping",
          collections.abc.Callable: "a callable"}


def signature(target: Callable) -> inspect.Signature | None:
    """The signature, each string annotation evaluated where it can be (one naming
    something its module imports only for type checkers stays a string); None if
    there is no signature."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    function = inspect.unwrap(target.__init__ if isinstance(target, type) else target)
    namespace = getattr(function, "__globals__", {})
    params = []
    for param in sig.parameters.values():
        if isinstance(param.annotation, str):
            try:
                param = param.replace(annotation=eval(param.annotation, namespace))  # noqa: S307
            except Exception:
                pass
        params.append(param)
    return sig.replace(parameters=params)


def _from_text(annotation: type) -> bool:
    """Classes whose constructors commonly take the text a YAML file holds."""
    import enum
    import os
    import pathlib

    return issubclass(annotation, enum.Enum | os.PathLike | pathlib.PurePath) or \
        f"{annotation.__module__}.{annotation.__name__}" == "torch.device"


def accepts(annotation: Any, value: Any) -> bool | None:
    """Whether ``value`` fits ``annotation``; None when the annotation cannot be judged."""
    if annotation in (Any, inspect.Parameter.empty) or isinstance(annotation, str):
        return _UNKNOWN
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        verdicts = [accepts(a, value) for a in typing.get_args(annotation)]
        if True in verdicts:
            return True
        return _UNKNOWN if _UNKNOWN in verdicts else False
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin is typing.Annotated:
        return accepts(typing.get_args(annotation)[0], value)
    if origin is not None:
        annotation = origin  # list[int] -> list, Sequence[str] -> Sequence
    if annotation is None or annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if not isinstance(annotation, type):
        return _UNKNOWN
    try:
        if isinstance(value, annotation):
            return True
        if isinstance(value, list | tuple):  # YAML has lists only: tuple, set, Iterable...
            return issubclass(annotation, collections.abc.Iterable) and \
                not issubclass(annotation, str | bytes | collections.abc.Mapping)
        return _UNKNOWN if isinstance(value, str) and _from_text(annotation) else False
    except TypeError:  # a protocol that is not runtime-checkable
        return _UNKNOWN


def describe(annotation: Any) -> str:
    """``Optional[int]`` -> "an integer or null"."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = dict.fromkeys(describe(a) for a in typing.get_args(annotation))
        return " or ".join(sorted(parts, key=lambda p: p == "null"))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    annotation = origin or annotation
    if annotation in _NAMES or annotation is None:
        return _NAMES[type(None) if annotation is None else annotation]
    return f"a {getattr(annotation, '__name__', annotation)}"


def expected_type(param: inspect.Parameter) -> Any:
    """The parameter's annotation, else what its default implies (a number, a flag)."""
    if param.annotation is not param.empty:
        return param.annotation
    default = param.default
    if isinstance(default, bool):
        return bool
    if isinstance(default, int | float):
        return float
    return inspect.Parameter.empty


def check_type(param: inspect.Parameter, value: Any, key: str) -> None:
    """Raise naming ``key`` when ``value`` does not fit the parameter."""
    if value is None and param.default is None:
        return  # "no value": what the default says, whatever the annotation claims
    wanted = expected_type(param)
    if accepts(wanted, value) is False:
        raise BuildError(key, f"expected {describe(wanted)}, got {value!r}")


def check_arguments(target: Callable, kwargs: Mapping[str, Any], key: str,
                    injected: Mapping[str, Any] = (), *, prefix: str | None = None,
                    skip_types: tuple[str, ...] = (), require: bool = True) -> None:
    """Name an unknown, missing or ill-typed keyword before calling, with what is accepted.

    ``prefix`` is the config path of the arguments (default ``<key>.config``);
    values named in ``injected`` or ``skip_types`` are not type-checked.
    """
    sig = signature(target)
    if sig is None:
        return  # no signature to check against (some builtins); the call itself will tell
    prefix = prefix or f"{key}.config"
    params = [p for p in sig.parameters.values() if p.name != "self"]
    keyword = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    label = getattr(target, "__qualname__", repr(target))
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
    for arg, value in kwargs.items():
        if arg in keyword:
            if arg not in injected and arg not in skip_types:
                check_type(keyword[arg], value, f"{prefix}.{arg}")
        elif not open_ended:
            offered = [n for n in keyword if n not in injected]
            raise BuildError(f"{prefix}.{arg}" if arg not in injected else key,
                             f"{label} does not accept '{arg}'{did_you_mean(arg, offered)}; "
                             f"it accepts: {', '.join(offered) or '(nothing)'}")
    missing = missing_arguments(target, kwargs, sig)
    if require and missing:
        raise BuildError(prefix, f"{label} requires {', '.join(map(repr, missing))}")


def missing_arguments(target: Callable, kwargs: Mapping[str, Any],
                      sig: inspect.Signature | None = None) -> list[str]:
    """Required keyword-capable parameters of ``target`` that ``kwargs`` does not give."""
    sig = sig or signature(target)
    if sig is None:
        return []
    return [p.name for p in sig.parameters.values() if p.name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty and p.name not in kwargs]


def _names_tensor(annotation: Any) -> bool:
    """``Tensor``, ``Optional[Tensor]``, ``Tensor | None``..."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_names_tensor(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__module__", "") == "torch" and \
        getattr(annotation, "__name__", "") == "Tensor"


def _numbers(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(_numbers(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)


def to_tensors(target: Callable, kwargs: dict[str, Any], skip=()) -> dict[str, Any]:
    """``kwargs`` with each (nested) list of numbers given where ``target``'s signature
    annotates a ``Tensor`` made a tensor of the default float dtype
    (``CrossEntropyLoss(weight=[1, 2, 1])``); anything else as it is."""
    sig = signature(target)
    if sig is None:
        return kwargs
    import torch

    params = sig.parameters
    return {k: torch.tensor(v, dtype=torch.get_default_dtype())
            if k not in skip and k in params and isinstance(v, list) and _numbers(v)
            and _names_tensor(params[k].annotation)
            else v for k, v in kwargs.items()}


PARTIAL_HINT = ("; to pass the function itself (bound to its config), not what it "
                "returns, add 'partial: true' to {key}")


def partial_hint(target: Callable, error: Exception, key: str) -> str:
    """The ``partial: true`` hint for a function whose call said it misses arguments."""
    if isinstance(target, type) or not isinstance(error, TypeError):
        return ""
    return PARTIAL_HINT.format(key=key) if "missing" in str(error) else ""


def check_call(target: Callable, kwargs: Mapping[str, Any], key: str,
               injected: Mapping[str, Any] = (), skip_types: tuple[str, ...] = ()) -> None:
    """:func:`check_arguments` before ``target(**kwargs)``; a function missing required
    arguments (``pad_collate`` without ``batch``) is told about ``partial: true``."""
    check_arguments(target, kwargs, key, injected, skip_types=skip_types, require=False)
    missing = missing_arguments(target, kwargs)
    if not missing:
        return
    label = getattr(target, "__qualname__", repr(target))
    if isinstance(target, type):
        raise BuildError(f"{key}.config", f"{label} requires {', '.join(map(repr, missing))}")
    raise BuildError(key, f"{label} is called when built, but it requires "
                     f"{', '.join(map(repr, missing))}" + PARTIAL_HINT.format(key=key))

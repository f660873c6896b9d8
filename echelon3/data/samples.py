"""A bad sample, named: its index and the config key of its data set, from any rank and any
loader worker, in one line.

Every map-style data set is wrapped in :class:`GuardedDataset` and every loader's
``collate_fn`` in :class:`GuardedCollate` when the loader is built. A ``__getitem__``
that raises, or samples of one batch whose shapes or dtypes differ, become a
:class:`DataError` naming ``data.train`` (or ``data.test.<name>``) and the index. Batches
remember the indices they hold, so a label outside the classes of a configured metric,
found when a loss or metric rejects the batch, is named the same way (on the CPU copy, so
even after a device-side assert).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping
from itertools import chain
from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, default_collate

from echelon3.config.errors import UserError

_PREFIX = f"{__name__}.DataError: "  # how a worker's traceback names it


class DataError(UserError):
    """A sample that cannot be used. Built again from torch's text when a loader worker
    raised it (torch re-raises a worker's exception as ``type(message)``)."""

    def __init__(self, key: str, message: str | None = None):
        if message is None:  # re-raised by torch from a loader worker
            lines = [line for line in str(key).splitlines() if line.startswith(_PREFIX)]
            key, _, message = (lines[-1][len(_PREFIX):] if lines else str(key)).partition(": ")
        super().__init__(key, message)


class Batch(list):
    """A collated batch that knows which samples it holds (``indices``) and where from
    (``key``). Slots, not a ``__dict__``: one is made per batch."""

    __slots__ = ("indices", "key")


class BatchDict(dict):
    __slots__ = ("indices", "key")


class _Samples(list):
    __slots__ = ("indices",)


class GuardedDataset(Dataset):
    """``dataset`` whose failures name the sample; everything else is passed through."""

    def __init__(self, dataset: Dataset, key: str):
        self.dataset, self.key = dataset, key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "key"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except UserError:
            raise
        except Exception as e:
            raise self._error(index, e) from e

    def __getitems__(self, indices: list[int]) -> list:
        samples = _Samples()
        try:  # one try for the batch; extend keeps what came before a raise: its index is next
            samples.extend(map(self.dataset.__getitem__, indices))
        except UserError:
            raise
        except Exception as e:
            raise self._error(indices[len(samples)], e) from e
        # The batch sampler hands over a new list per batch: kept as it is.
        samples.indices = indices if type(indices) is list else list(indices)
        return samples

    def _error(self, index, e: Exception) -> DataError:
        text = str(e).strip()
        return DataError(self.key, f"sample {index}: {type(e).__name__}: "
                         f"{text.splitlines()[0] if text else ''}")


def _signature(sample: Any) -> Any:
    if isinstance(sample, torch.Tensor):
        return (sample.shape, sample.dtype)  # torch.Size: a tuple
    if isinstance(sample, Mapping):
        return {k: _signature(v) for k, v in sample.items()}
    if isinstance(sample, list | tuple):
        return [_signature(v) for v in sample]
    return type(sample).__name__


def _describe(signature: Any) -> str:
    if isinstance(signature, tuple) and len(signature) == 2:
        shape, dtype = signature
        return f"shape {list(shape)} {str(dtype).replace('torch.', '')}"
    return str(signature)


def _first_difference(a: Any, b: Any) -> tuple[Any, Any]:
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for k in a:
            if a[k] != b[k]:
                return _first_difference(a[k], b[k])
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b):
            if x != y:
                return _first_difference(x, y)
    return a, b


_DTYPE = operator.attrgetter("dtype")


def _all_alike(samples: list) -> bool:
    """True when the first sample is a tuple or list and the dtypes of all samples' fields,
    one after another, are the first's repeated: the common case, checked in C (``map``,
    ``chain``, one list comparison) without building signatures. Shapes, and samples of
    unequal lengths whose dtypes happen to line up, are left to the collate, which refuses
    them (mixed dtypes it would promote silently). False means "look closer"
    (:func:`_signature`), not "different"."""
    first = samples[0]
    if type(first) is not tuple and type(first) is not list:
        return False
    try:
        return list(map(_DTYPE, chain.from_iterable(samples))) == \
            list(map(_DTYPE, first)) * len(samples)
    except (AttributeError, TypeError):  # a field without a dtype, a sample not a sequence
        return False


class GuardedCollate:
    """``collate_fn`` that names a sample unlike the first of its batch; with the default
    collate, samples must agree in shape and dtype (a custom one may pad)."""

    def __init__(self, collate_fn=None, key: str = ""):
        self.collate_fn, self.key = collate_fn, key
        self.strict = collate_fn is None or collate_fn is default_collate

    def _odd_one(self, samples: list, indices: list[int]) -> DataError | None:
        """The error naming the first sample unlike the batch's first, by signatures."""
        first = _signature(samples[0])
        for index, sample in zip(indices[1:], samples[1:]):
            signature = _signature(sample)
            if signature != first:
                theirs, ours = _first_difference(signature, first)
                return DataError(self.key, f"sample {index}: {_describe(theirs)}, but sample "
                                 f"{indices[0]} of the same batch has {_describe(ours)}")
        return None

    def __call__(self, samples: list):
        indices = samples.indices if type(samples) is _Samples else list(range(len(samples)))
        odd = None if not self.strict or not samples or _all_alike(samples) else \
            self._odd_one(samples, indices)
        if odd is not None:
            raise odd
        try:  # the default collate takes the list as it is; another gets a plain list
            batch = default_collate(samples) if self.collate_fn is None else \
                self.collate_fn(list(samples))
        except Exception as e:
            odd = self._odd_one(samples, indices) if samples else None
            if odd is None:
                raise
            raise odd from e
        marked = Batch(batch) if type(batch) is list else \
            BatchDict(batch) if type(batch) is dict else batch
        if marked is not batch:
            marked.indices, marked.key = indices, self.key
        return marked


def _label_classes(metrics: Mapping) -> tuple[str, int] | None:
    for name, metric in (metrics or {}).items():
        classes = getattr(metric, "num_classes", None)
        if isinstance(classes, int) and not isinstance(classes, bool) and classes > 0:
            return name, classes
    return None


@contextlib.contextmanager
def naming_bad_labels(batch: Any, metrics: Mapping) -> Iterator[None]:
    """When a loss or metric fails on ``batch``, name a label outside the classes of the
    first metric that has ``num_classes``; any other failure passes through unchanged."""
    try:
        yield
    except LABEL_ERRORS as e:
        found = bad_label(batch, metrics)
        if found is None:
            raise
        raise found from e


LABEL_ERRORS = (IndexError, RuntimeError, ValueError)  # what a loss or metric raises on one


def bad_label(batch: Any, metrics: Mapping) -> DataError | None:
    """The error naming a label of ``batch`` outside the classes of the first metric that
    has ``num_classes``; None when every label is inside (the failure was something else).
    The training loop calls it in its own ``except``: no context manager per micro-batch."""
    indices = getattr(batch, "indices", None)
    classes = _label_classes(metrics)
    if not indices or classes is None:
        return None
    target = batch[1] if isinstance(batch, list) else batch.get("target")
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None
    name, count = classes
    flat = target.reshape(len(indices), -1) if target.numel() else target
    bad = ((flat < 0) | (flat >= count)).reshape(len(indices), -1).any(dim=1)
    if not bad.any():
        return None
    row = int(bad.nonzero()[0])
    value = flat[row][(flat[row] < 0) | (flat[row] >= count)][0].item()
    return DataError(getattr(batch, "key", "data"), f"sample {indices[row]}: label {value} is "
                     f"outside the {count} classes (0 to {count - 1}) of metrics.{name}")

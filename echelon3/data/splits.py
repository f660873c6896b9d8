"""Which data validates a run, and ``data.val_split``: a validation set carved from ``data.train``.

Validation during training (and so ``keep_best_on`` and ``best.tar``) uses, in order:
``data.val`` (one dataset or named sets); else the part of ``data.train`` that
``data.val_split`` sets aside (the train set loses those samples); else
``data.test``, which then both selects and reports, and every place that shows a
number says "selected on the test set".

``data.val_split`` is a fraction in (0, 1) of the train set (rounded up) or a whole
number of samples. The split is drawn from root ``seed`` with scikit-learn's
``train_test_split``, stratified when the dataset has per-sample labels (a
``targets`` or ``labels`` attribute, as torchvision's datasets and
``echelon3.datasets.digits`` have) and every class can give samples to both sides.

A run's checkpoints remember how its split was drawn (:func:`record`: a hash of
``data.train``'s config, the fraction and the seed). A run started with ``init_from``
from such a checkpoint, on the same ``data.train``, validates on its parent's
validation samples, which the parent never trained on (:func:`for_child`): the parent's
fraction and seed are used, whatever its own say, so a seed sweep over fine-tuned runs
still validates on unseen data. A parent that trained on the whole of ``data.train``
leaves no unseen sample there: ``data.val_split`` is refused, naming the parent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset, Subset

from echelon3.config.errors import ConfigError

log = logging.getLogger(__name__)

KEY = "data.val_split"
VAL, TEST = "val", "test"  # which data chose best.tar (summary.json, metrics.json)
LABEL_ATTRIBUTES = ("targets", "labels")
RECORD = "validation_split"  # in a checkpoint: how its run's validation set was drawn


def _train_identity(data) -> str:
    from omegaconf import OmegaConf

    spec = data.get("train")
    plain = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else spec
    text = json.dumps(plain, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def record(data, split: tuple[Any, int] | None) -> dict:
    """What a checkpoint keeps of the run's split: ``data.train``'s identity and the
    fraction and seed drawn with (None for both when nothing was carved)."""
    value, seed = split if split is not None else (None, None)
    return {"train": _train_identity(data), "val_split": value, "seed": seed}


def for_child(data, seed: int, parent: dict | None, source: str) -> tuple[Any, int] | None:
    """(fraction, seed) to carve ``data.val_split`` with, or None when nothing is carved.

    ``parent``: the :func:`record` of the checkpoint ``init_from`` names (None: not an
    echelon3 checkpoint, or from before the record existed: nothing to compare with).
    """
    own = data.get("val_split")
    if own is None or data.get("val") is not None:
        return None if own is None else (own, seed)
    if parent is None or parent.get("train") != _train_identity(data):
        return own, seed
    if parent.get("val_split") is None:
        raise ConfigError(KEY, f"every sample of data.train trained the run init_from "
                          f"starts from ({source}), so none validates this one fairly; give "
                          "data.val, or validate on data.test (data.val_split=null)")
    inherited = parent["val_split"], int(parent["seed"])
    if inherited != (own, seed):
        log.info("%s: validating on the samples init_from's run (%s) set aside (%s of "
                 "data.train, seed %d), not on a draw of %s with seed %d, which would hold "
                 "samples it trained on", KEY, source, inherited[0], inherited[1], own, seed)
    return inherited


def selected_on(data) -> str:
    """``val`` when the config gives validation data (``data.val`` or ``data.val_split``),
    else ``test``."""
    if data is None:
        return TEST
    return VAL if data.get("val") is not None or data.get("val_split") is not None else TEST


def describe(selected: str) -> str:
    """How a report names the data that chose best.tar."""
    return "selected on the validation set" if selected == VAL else "selected on the test set"


def val_size(value: Any, size: int) -> int:
    """The number of samples ``data.val_split: value`` takes from a train set of ``size``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(KEY, f"must be a fraction in (0, 1) or a whole number of samples, "
                          f"got {value!r}")
    if isinstance(value, float):
        if not 0 < value < 1:
            raise ConfigError(KEY, f"a fraction must lie strictly between 0 and 1, got {value}")
        count = math.ceil(value * size)
    else:
        count = value
    if not 1 <= count < size:
        raise ConfigError(KEY, f"{value!r} of data.train's {size} samples leaves "
                          f"{size - count} to train on and {count} to validate; both need at "
                          "least one")
    return count


def labels_of(dataset: Dataset) -> np.ndarray | None:
    """Per-sample class labels from a ``targets`` or ``labels`` attribute, or None."""
    for name in LABEL_ATTRIBUTES:
        labels = getattr(dataset, name, None)
        if labels is None:
            continue
        try:
            array = np.asarray(labels.cpu() if hasattr(labels, "cpu") else labels)
        except (TypeError, ValueError):
            return None
        if array.ndim == 1 and len(array) == len(dataset) and (
                array.dtype.kind in "iub" or array.dtype.kind == "U"):
            return array
    return None


def carve(dataset: Dataset, value: Any, seed: int) -> tuple[Subset, Subset]:
    """(train, validation): disjoint subsets of ``dataset`` covering all of it."""
    from sklearn.model_selection import train_test_split

    if isinstance(dataset, IterableDataset):
        raise ConfigError(KEY, "data.train is an IterableDataset, which cannot be split by "
                          "index; give data.val instead")
    size = len(dataset)
    count = val_size(value, size)
    indices = np.arange(size)
    labels = labels_of(dataset)
    state = seed % 2**32
    try:
        train, val = train_test_split(indices, test_size=count, random_state=state,
                                      stratify=labels)
    except ValueError as e:  # a class too small for both sides, or fewer samples than classes
        log.info("%s: not stratified (%s); drawing the validation samples at random", KEY, e)
        labels = None
        train, val = train_test_split(indices, test_size=count, random_state=state)
    log.info("%s: %d of data.train's %d samples validate, %d train%s", KEY, len(val), size,
             len(train), " (stratified by label)" if labels is not None else "")
    return Subset(dataset, sorted(train.tolist())), Subset(dataset, sorted(val.tolist()))

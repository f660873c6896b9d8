"""Each root section built into its objects: the net, the data sets, losses, metrics, the
optimizer, the checkpoint target, the logger and the trainer.

Every section goes through :func:`echelon3.config.build.instantiate`; each builder says
which runtime objects it injects (a YAML that sets one of them is an error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from omegaconf import DictConfig, ListConfig

from echelon3.config.build import instantiate, is_spec, named_items, to_plain, with_default_type
from echelon3.config.errors import BuildError, did_you_mean


def build_net(cfg, config_dir: Path | None = None):
    """``net``: injects nothing; ``net.weights`` (optional) loads a state_dict or checkpoint."""
    net = instantiate(cfg.net, "net", config_dir, extra_keys=("weights",))
    weights = cfg.net.get("weights")
    if weights:
        import torch

        from echelon3.checkpoints.files import strip_prefixes

        path = Path(weights)
        if not path.is_absolute() and config_dir is not None and (config_dir / path).exists():
            path = config_dir / path
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise BuildError("net.weights", f"cannot load {path}: {str(e).splitlines()[0]}") from e
        state = state.get("model_state_dict", state) if isinstance(state, dict) else state
        try:
            net.load_state_dict(strip_prefixes(state))
        except RuntimeError as e:
            raise BuildError("net.weights", f"{path} does not fit the network: "
                             f"{' '.join(line.strip() for line in str(e).splitlines()[:2])}") from e
    return net


def _dataset_sets(node, key: str, config_dir: Path | None):
    """One dataset (``{key: set}``, not named) or named sets -> ({name: set}, named?)."""
    if is_spec(node):
        return {key.rsplit(".", 1)[-1]: instantiate(node, key, config_dir)}, False
    if not isinstance(node, Mapping | DictConfig | list | ListConfig):
        raise BuildError(key, f"must be a dataset (module, type, config) or named sets, "
                         f"got {node!r}")
    sets = {name: instantiate(spec, f"{key}.{name}", config_dir)
            for name, spec in named_items(node, key)}
    if not sets:
        raise BuildError(key, "no data set configured")
    return sets, True


def build_datasets(cfg, config_dir: Path | None = None, train: bool = True,
                   split: tuple | None = None):
    """``data``, for training: (train set, validation sets, named?); with ``train=False``:
    (None, test sets, named?). Validation sets are ``data.val``, else what
    ``data.val_split`` carves from the train set (with ``split``'s fraction and seed when
    given, else its own and root ``seed``), else ``data.test`` (:mod:`echelon3.data.splits`)."""
    from echelon3.data import splits

    data = cfg.data
    if train:
        if data.get("train") is None:
            raise BuildError("data.train", "required section missing for 'train'")
        train_set = instantiate(data.train, "data.train", config_dir)
        if data.get("val") is not None:
            if data.get("val_split") is not None:
                raise BuildError("data.val_split", "give data.val or data.val_split, not both")
            return (train_set, *_dataset_sets(data.val, "data.val", config_dir))
        if data.get("val_split") is not None:
            value, seed = split or (data.val_split, int(cfg.get("seed", 0)))
            train_set, val_set = splits.carve(train_set, value, seed)
            return train_set, {splits.VAL: val_set}, False
    test = data.get("test")
    if test is None:
        raise BuildError("data.test", "required section missing (evaluation needs a test set, "
                         "and validation too unless data.val or data.val_split is given)")
    return (train_set if train else None, *_dataset_sets(test, "data.test", config_dir))


def build_losses(cfg, config_dir: Path | None = None, required: bool = True, device=None):
    """``loss``: [{name: {module, type, config, weight, input_key, target_key}}] ->
    {name: (fn, weight)}, on ``device``; ``input_key`` / ``target_key`` pick one entry of
    a mapping output / target (:class:`echelon3.data.batches.Keyed`). ``loss:
    from_output``: the network's own loss (:class:`echelon3.data.batches.OutputLoss`)."""
    from echelon3.data.batches import FROM_OUTPUT, Keyed, loss_on_device

    if cfg.get("loss") is None:
        if required:
            raise BuildError("loss", "required section missing for 'train'")
        return {}
    if cfg.loss == FROM_OUTPUT:
        return output_loss(cfg, config_dir)
    losses = {}
    for name, spec in named_items(cfg.loss, "loss"):
        key = f"loss.{name}"
        weight = spec.get("weight", 1.0) if isinstance(spec, Mapping | DictConfig) else 1.0
        if not isinstance(weight, int | float):
            raise BuildError(f"{key}.weight", f"must be a number, got {weight!r}")
        fn = instantiate(spec, key, config_dir, extra_keys=("weight", *KEYS))
        fn = loss_on_device(fn, device)
        if any(spec.get(k) is not None for k in KEYS):
            fn = Keyed(fn, spec.get("input_key"), spec.get("target_key"), key)
        losses[name] = (fn, float(weight))
    if required and not losses:
        raise BuildError("loss", "lists no loss")
    return losses


def output_loss(cfg, config_dir: Path | None = None):
    """``loss: from_output``, checked against the class ``net`` names when it is one (a
    factory's network is checked at its first forward)."""
    import inspect

    from echelon3.config.build import resolve_type
    from echelon3.data.batches import OutputLoss, target_keyword

    net = cfg.get("net")
    if is_spec(net):
        made = resolve_type(net, "net", config_dir)
        forward = getattr(made, "forward", None) if inspect.isclass(made) else None
        if forward is not None:
            signature = inspect.signature(forward)  # unbound: without self
            target_keyword(signature.replace(parameters=list(
                signature.parameters.values())[1:]), made.__name__)
    return OutputLoss()


KEYS = ("input_key", "target_key")  # a loss or metric reading one entry of a mapping


def build_metrics(cfg, config_dir: Path | None = None, device=None):
    """``metrics``: [{name: triple}] -> {name: metric} on ``device``; unusable ones rejected.
    A function (``partial: true``) becomes a :class:`FunctionMetric`; ``input_key`` /
    ``target_key`` make a :class:`KeyedMetric` (:mod:`echelon3.metrics.adapters`)."""
    from echelon3.metrics.adapters import FunctionMetric, KeyedMetric
    from echelon3.metrics.base import is_usable_metric

    metrics = {}
    for name, spec in named_items(cfg.get("metrics"), "metrics"):
        key = f"metrics.{name}"
        metric = instantiate(spec, key, config_dir, extra_keys=KEYS)
        if spec.get("partial") and not isinstance(getattr(metric, "func", metric), type):
            metric = FunctionMetric(metric)
        if not is_usable_metric(metric):
            raise BuildError(key, f"{type(metric).__name__} is not a metric: it needs "
                             "update(preds, target), compute() and reset() (a function "
                             "fn(preds, target) takes partial: true)")
        metric = metric.to(device) if device is not None else metric
        if any(spec.get(k) is not None for k in KEYS):
            metric = KeyedMetric(metric, spec.get("input_key"), spec.get("target_key"), key)
        metrics[name] = metric
    return metrics


def build_optimizer(cfg, params, config_dir: Path | None = None, net=None):
    """``optimizer``: injects ``params=`` (parameters, or groups of them). With
    ``optimizer.no_decay`` each group is split into decayed parameters and the rest at
    ``weight_decay`` 0.0, by ``net``'s names and module types
    (:mod:`echelon3.optimizers.decay`)."""
    import logging

    if cfg.get("optimizer") is None:
        raise BuildError("optimizer", "required section missing for 'train'")
    rules = cfg.optimizer.get("no_decay")
    if rules is None:
        return instantiate(cfg.optimizer, "optimizer", config_dir, params=params)
    from echelon3.optimizers.decay import KEY, NoDecay, describe

    if net is None:
        raise BuildError(KEY, "needs the network, whose parameter names the rules read")
    groups = NoDecay.from_config(to_plain(rules)).groups(net, params)
    optimizer = instantiate(cfg.optimizer, "optimizer", config_dir, extra_keys=("no_decay",),
                            params=groups)
    logging.getLogger(__name__).info("optimizer.no_decay: %s", describe(optimizer))
    return optimizer


def build_target(cfg, config_dir: Path | None = None):
    """``target``: ``path``, retention, step checkpoints and ``async_save`` for the
    checkpoint manager."""
    target = cfg.get("target")
    if target is None or not target.get("path"):
        raise BuildError("target.path", "required: the directory for checkpoints and results")
    node = to_plain(target)
    if not is_spec(node):
        known = ("path", "checkpoints_to_keep", "every_n_steps", "every_n_minutes",
                 "step_checkpoints_to_keep", "async_save")
        for k in node:
            if k not in known:
                raise BuildError(f"target.{k}", f"unknown key{did_you_mean(str(k), known)}; "
                                 f"target takes {', '.join(known)}")
        node = {"module": "echelon3.checkpoints.files", "type": "CheckpointManager", "config": node}
    return instantiate(node, "target", config_dir)


def build_mlops(cfg, path, config_dir: Path | None = None):
    """``mlops`` (optional; rank 0 only): injects ``path=`` (the run directory)."""
    spec = with_default_type(cfg.get("mlops"), "mlops", "echelon3.observe.loggers", "DefaultLogger")
    return instantiate(spec, "mlops", config_dir, path=path)


def build_trainer(cfg, config_dir: Path | None = None, runtime_keys=(), **injected):
    """``trainer``: injects the assembled run (net, losses, optimizer, loaders, ...)."""
    spec = with_default_type(cfg.get("trainer"), "trainer", "echelon3.trainers.baseline",
                             "Trainer")
    spec["config"] = {k: v for k, v in (spec.get("config") or {}).items()
                      if k not in runtime_keys}
    return instantiate(spec, "trainer", config_dir, **injected)

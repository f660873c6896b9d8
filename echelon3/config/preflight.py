"""The pre-flight: every component of a config checked before processes start or data is built.

Every ``module`` is imported and every ``type`` found; every component's keyword
arguments are checked by name and value type against its signature
(:mod:`echelon3.config.arguments`), the built-ins of sections that leave ``module`` /
``type`` out (trainer, mlops, evaluator, runner, target) included. What echelon3
injects at run time, and required arguments, are checked when each section is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omegaconf import OmegaConf

from echelon3.config.arguments import check_arguments
from echelon3.config.arithmetic import with_lengths
from echelon3.config.build import is_spec, iter_specs, resolve_type, to_plain, with_default_type
from echelon3.config.derived import with_placeholders
from echelon3.config.errors import BuildError

# What each section's builder injects (see echelon3.config.build and echelon3.data.loaders).
INJECTED = {
    "optimizer": ("params",), "scheduler": ("optimizer",), "mlops": ("path",),
    "evaluator": ("path",), "runner": ("path",),
    "trainer": ("net", "losses", "optimizer", "scheduler", "train_loader", "test_loaders",
                "metrics", "checkpoints", "logger", "precision", "device", "named_sets",
                "resume_state", "extra_state", "scheduler_interval"),
}
# Sections whose ``module``/``type`` may be left out, and the built-in used then.
BUILT_IN = {
    "trainer": ("echelon3.trainers.baseline", "Trainer"),
    "mlops": ("echelon3.observe.loggers", "DefaultLogger"),
    "evaluator": ("echelon3.tasks.evaluate", "Evaluator"),
    "runner": ("echelon3.tasks.run", "Runner"),
}


def _section_specs(section: str, node: Any, dropped: tuple[str, ...]):
    """(key, spec, config path of its arguments) of every triple in a root section,
    the built-in of a section that leaves ``module``/``type`` out included."""
    plain = to_plain(node)
    prefix = None
    if section == "target" and isinstance(plain, dict) and not is_spec(plain):
        plain, prefix = {"module": "echelon3.checkpoints.files", "type": "CheckpointManager",
                         "config": plain}, section
    elif section in BUILT_IN and not is_spec(plain):
        prefix = f"{section}.config" if "config" in (plain or {}) else section
        plain = with_default_type(plain, section, *BUILT_IN[section])
    if is_spec(plain) and isinstance(plain.get("config"), dict):
        plain["config"] = {k: v for k, v in plain["config"].items() if k not in dropped}
    if prefix is None:
        for key, spec in iter_specs(plain, section):
            yield key, spec, f"{key}.config"
        return
    yield section, plain, prefix
    for key, spec in iter_specs(plain["config"], prefix):
        yield key, spec, f"{key}.config"


def check_specs(cfg, config_dir: Path | None = None, skip: tuple[str, ...] = (),
                consumed: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """Import every ``module``, find every ``type`` and check every component's keyword
    arguments (names and value types) now, before processes start or data is built.

    Root keys in ``skip`` and the user's own ``_`` keys are left out; ``consumed`` names,
    per section, keys the task reads itself rather than passing on (trainer's
    ``precision``). Arguments echelon3 injects and required ones are checked at build time.
    """
    for section, node in cfg.items():
        if section in skip or str(section).startswith("_"):
            continue
        missing = sorted(OmegaConf.missing_keys(node)) if OmegaConf.is_config(node) else []
        if missing:
            raise BuildError(missing[0], "has no value ('???'); set it in the YAML or with "
                             f"{missing[0]}=...")
        node = with_placeholders(node)  # ${calc:...} that waits for the data: 1 stands in
        if section == "scheduler" and node is not None:  # null: the inherited one dropped
            node = with_lengths(node)  # lengths like ``total_steps - 500``
        dropped = tuple((consumed or {}).get(section, ()))
        for key, spec, prefix in _section_specs(str(section), node, dropped):
            target = resolve_type(spec, key, config_dir)
            kwargs = to_plain(spec.get("config")) or {}
            if not isinstance(kwargs, dict):
                continue  # reported with its key when the section is built
            built_later = [k for k, v in kwargs.items() if is_spec(v)]
            injected = INJECTED.get(key, ()) if key == section else ()
            check_arguments(target, kwargs, key, dict.fromkeys(injected), prefix=prefix,
                            require=False,
                            skip_types=(*getattr(target, "lazy_specs", ()), *built_later))

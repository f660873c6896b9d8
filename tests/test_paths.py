"""Module paths users write keep working: every ``echelon3.*`` path the shipped configs, the
docs and README name resolves, and the paths from before the package was grouped into
wings still import, to the same objects, with a warning naming the new home."""

from __future__ import annotations

import importlib
import re
import sys
import warnings

import pytest
from omegaconf import OmegaConf

import echelon3
from echelon3.config.build import instantiate
from tests.conftest import REPO

PATH = re.compile(r"(?<![\w./-])echelon3(?:\.[A-Za-z_]\w*)+")
# Not module paths: file names, the run lock's name, the MLflow tags echelon3 sets.
NOT_PATHS = {"echelon3.yaml", "echelon3.lock", "echelon3.version", "echelon3.task"}
# What the user's own page (the spec) names; it lives outside the repository.
SPEC_PAGE = ("echelon3.metrics.base.Metric", "echelon3.metrics.base.all_reduce_sum_",
             "echelon3.nets.mlp")


def named_paths() -> dict[str, str]:
    """{dotted path: first file naming it} over config/, docs/ and README."""
    files = [*sorted((REPO / "config").rglob("*.yaml")), *sorted((REPO / "docs").glob("*.md")),
             REPO / "README.md"]
    found: dict[str, str] = {}
    for path in files:
        for match in PATH.findall(path.read_text()):
            if match not in NOT_PATHS:
                found.setdefault(match, str(path.relative_to(REPO)))
    return found


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    if len(parts) > 1 and parts[1] in echelon3.LAZY:  # echelon3.predict: the API's function
        target = echelon3
        for attr in parts[1:]:
            target = getattr(target, attr)
        return target
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ModuleNotFoundError(dotted)


def test_the_pages_name_paths_at_all():
    paths = named_paths()
    assert {"echelon3.nets.mlp", "echelon3.metrics.base", "echelon3.trainers.baseline",
            "echelon3.datasets.digits"} <= set(paths), sorted(paths)


def test_every_path_the_configs_docs_and_readme_name_resolves():
    broken = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # an old path in the docs is stale
        for dotted, where in sorted(named_paths().items()):
            try:
                resolve(dotted)
            except (ImportError, AttributeError, FutureWarning) as e:
                broken.append(f"{where}: {dotted}: {e}")
    assert not broken, "\n".join(broken)


def test_the_spec_pages_paths_resolve():
    for dotted in SPEC_PAGE:
        resolve(dotted)


def test_every_component_a_shipped_config_names_is_found():
    """Each ``module``/``type`` pair of config/ resolves to a callable (what the builder
    does first)."""
    from echelon3.config.build import resolve_type

    checked = 0
    for path in sorted((REPO / "config").rglob("*.yaml")):
        for spec in _triples(OmegaConf.to_container(OmegaConf.load(path))):
            if str(spec["module"]).startswith("echelon3"):
                assert callable(resolve_type(spec, str(path.relative_to(REPO)))), spec
                checked += 1
    assert checked >= 10, checked


def _triples(node):
    if isinstance(node, dict):
        if isinstance(node.get("module"), str) and isinstance(node.get("type"), str):
            yield node
        for value in node.values():
            yield from _triples(value)
    elif isinstance(node, list):
        for value in node:
            yield from _triples(value)


@pytest.mark.parametrize("old,name,new", [
    ("echelon3.dist", "is_main", "echelon3.distributed.ranks"),
    ("echelon3.dist", "detect_launcher", "echelon3.distributed.launch"),
    ("echelon3.mlops", "DefaultLogger", "echelon3.observe.loggers"),
    ("echelon3.mlops.base", "JsonlLogger", "echelon3.observe.loggers"),
    ("echelon3.export", "Standardize", "echelon3.nets.preprocess"),
    ("echelon3.build", "build_net", "echelon3.tasks.components"),
    ("echelon3.checkpoint", "atomic_save", "echelon3.checkpoints.files"),
    ("echelon3.evaluate", "Evaluator", "echelon3.tasks.evaluate"),
    ("echelon3.precision", "Precision", "echelon3.distributed.precision"),
    ("echelon3.predict", "OnnxNet", "echelon3.tasks.predict"),
])
def test_an_old_path_imports_the_same_object_with_a_warning(old, name, new):
    sys.modules.pop(old, None)  # imported by an earlier case: import it anew
    with pytest.warns(FutureWarning, match=f"{re.escape(old)} moved to"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_an_old_path_named_like_an_api_function_is_still_that_function():
    """``import echelon3.predict`` (the old home of the predict task) makes the module the
    package's ``predict``; called, it is still ``echelon3.api.predict``."""
    from echelon3 import api

    sys.modules.pop("echelon3.predict", None)
    with pytest.warns(FutureWarning, match="echelon3.predict moved to"):
        importlib.import_module("echelon3.predict")
    calls = []
    original = api.predict
    api.predict = lambda *args, **kwargs: calls.append((args, kwargs)) or "outputs"
    try:
        assert echelon3.predict("run", [1.0], batch_size=2) == "outputs"
    finally:
        api.predict = original
    assert calls == [(("run", [1.0]), {"batch_size": 2})]


def test_an_old_path_in_a_config_builds():
    sys.modules.pop("echelon3.mlops", None)
    spec = OmegaConf.create({"module": "echelon3.mlops", "type": "NoOpLogger",
                             "config": {"path": "unused"}})
    with pytest.warns(FutureWarning, match="echelon3.mlops moved to echelon3.observe.loggers"):
        logger = instantiate(spec, "mlops")
    assert type(logger).__module__ == "echelon3.observe.loggers"


def test_every_old_path_has_a_home():
    for old, homes in echelon3.MOVED.items():
        for home in homes:
            importlib.import_module(f"echelon3.{home}")

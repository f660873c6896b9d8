"""Any config, any command line: exit 0, or exit 2 with one line naming the key; never a
traceback, never a hang. Hypothesis generates override lists and whole config trees (wrong
types, missing sections, unknown keys, huge and negative numbers, unicode, deep nesting,
YAML anchors) with a fixed seed. Each goes through the real CLI entry point in this process
up to the point where training would start: the config is composed, checked, every
component is built and the trainer constructed; only ``Trainer.fit`` and the spawning of
workers are left out, so hundreds of examples take seconds.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echelon3 import cli
from echelon3.distributed import launch as dist
from echelon3.trainers import baseline
from tests.helpers import base_config

PROMISE = "any config or command line: exit 0, or exit 2 with one line naming the key"
OVERRIDE_EXAMPLES = 250
TREE_EXAMPLES = 100  # 350 inputs per run
FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _dotted(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{prefix}{k}"
            yield from _dotted(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield f"{prefix}{i}"
            yield from _dotted(v, f"{prefix}{i}.")


BASE = base_config(Path("out"))
KEYS = sorted(set(_dotted(BASE)))
SECTIONS = sorted(BASE)

# Text that stays a relative name inside the test's folder when it lands in target.path.
words = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\x00"),
                min_size=1, max_size=12).filter(lambda s: not s.startswith((".", "~", "-")))
numbers = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63]),
                    st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(numbers, st.booleans(), st.none(), words,
                    st.sampled_from(["torch.nn", "echelon3.nets.mlp", "nope.nope", "MLP", "SGD",
                                     "fp16", "cuda", "cpu", "auto", "restart", "skip", "???"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["a", "module", "type",
                                                                  "config", "weight", "ü"]),
                                                 inner, max_size=3)), max_leaves=6)
keys = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k + ".extra"),
                 st.tuples(st.sampled_from(SECTIONS), words).map(".".join), words)


def _render(value) -> str:
    """An override's right-hand side, as a user would type it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip()
    return str(value)


# Mostly real keys with values of every type, so most inputs get past the parser into the
# builders; now and then a deletion, an unknown key or plain junk.
real_keys = st.sampled_from(KEYS)
overrides = st.lists(st.one_of(
    st.tuples(st.sampled_from(["", "+", "++"]), real_keys, values).map(
        lambda t: f"{t[0]}{t[1]}={_render(t[2])}"),
    st.tuples(real_keys, values).map(lambda t: f"{t[0]}={_render(t[1])}"),
    st.tuples(real_keys, scalars).map(lambda t: f"{t[0]}={_render(t[1])}"),
    real_keys.map(lambda k: f"~{k}"),
    st.tuples(keys, values).map(lambda t: f"{t[0]}={_render(t[1])}"),
    words), min_size=1, max_size=3)


def _node(cfg, path):
    node = cfg
    for part in path:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


@st.composite
def trees(draw):
    """The base config bent in a few places; ``yaml.dump`` turns shared nodes into anchors."""
    cfg = base_config(Path("out"))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(KEYS)).split(".")
        parent = _node(cfg, path[:-1])
        last = int(path[-1]) if isinstance(parent, list) and path[-1].isdigit() else path[-1]
        if isinstance(parent, dict) and last in parent or \
                isinstance(parent, list) and isinstance(last, int) and last < len(parent):
            action = draw(st.sampled_from(["delete", "replace", "unknown", "nest", "alias"]))
            if action == "delete":
                del parent[last]
            elif action == "replace":
                parent[last] = draw(values)
            elif action == "unknown" and isinstance(parent, dict):
                parent[draw(words)] = draw(values)
            elif action == "nest":
                deep = draw(values)
                for _ in range(draw(st.integers(1, 60))):
                    deep = {"config": deep}
                parent[last] = deep
            elif action == "alias":  # the same node twice: an anchor and an alias in YAML
                parent[last] = cfg.get(draw(st.sampled_from(SECTIONS)))
    return cfg


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A scratch working directory; the training loop and the spawning are left out."""
    path = tmp_path_factory.mktemp("fuzz")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(baseline.Trainer, "fit", lambda self: None)
        mp.setattr(dist, "spawn", lambda *args, **kwargs: None)
        mp.chdir(path)
        yield path


def _outcome(folder: Path, argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


def _check(code: int, err: str, what) -> None:
    assert "Traceback" not in err, (what, err)
    assert code in (0, 2), (what, code, err)
    lines = [line for line in err.splitlines() if line.startswith("echelon3:")]
    if code == 2:
        assert len(lines) == 1, (what, err)
        assert re.match(r"echelon3: error: \S.*?: ", lines[0]), (what, lines[0])
    else:
        assert lines == [], (what, err)


def test_generated_override_lists(folder, ledger):
    tried = []

    @settings(FUZZ, max_examples=OVERRIDE_EXAMPLES)
    @given(argv=overrides)
    def check(argv):
        (folder / "run.yaml").write_text(yaml.safe_dump(base_config(Path("out"))))
        code, err = _outcome(folder, ["train", "-cd", str(folder), "-cn", "run", *argv])
        _check(code, err, argv)
        tried.append(argv)

    check()
    assert len(tried) >= OVERRIDE_EXAMPLES
    ledger(PROMISE, inputs=len(tried))


def test_generated_config_trees(folder, ledger):
    tried = []

    @settings(FUZZ, max_examples=TREE_EXAMPLES)
    @given(cfg=trees(), command=st.sampled_from(["train", "train", "evaluate", "run"]))
    def check(cfg, command):
        text = yaml.dump(cfg, allow_unicode=True, sort_keys=False)
        (folder / "tree.yaml").write_text(text)
        code, err = _outcome(folder, [command, "-cd", str(folder), "-cn", "tree"])
        _check(code, err, text)
        tried.append(text)

    check()
    assert len(tried) >= TREE_EXAMPLES
    ledger(PROMISE, inputs=len(tried))

"""A ``.py`` file named by path in a config imports the files beside it, stays in
``sys.modules`` under one name, and trains compiled (the 2-process case runs in
tests/test_derived.py, whose network comes from such a file)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from echelon3.config.build import import_module, instantiate
from echelon3.config.errors import BuildError
from tests.conftest import edit_yaml, probe_config
from tests.helpers import echelon3

MODEL = """\
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, features=7, classes=2):
        super().__init__()
        self.fc = nn.Linear(features, classes)

    def forward(self, x):
        return self.fc(torch.tanh(x[:, 1:]))
"""
NET = """\
from model import Tiny
from layers_{tag}.widths import CLASSES


def make(features=7):
    return Tiny(features, CLASSES)
"""


def write_user_files(folder: Path, tag: str) -> Path:
    """``net.py`` beside ``model.py`` and a package ``layers_<tag>/``, as a user writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL)
    (folder / "net.py").write_text(NET.format(tag=tag))
    (folder / f"layers_{tag}").mkdir()
    (folder / f"layers_{tag}" / "__init__.py").write_text("")
    (folder / f"layers_{tag}" / "widths.py").write_text("CLASSES = 2\n")
    return folder


@pytest.fixture
def fresh_model():
    """``model`` is the sibling's top-level name: forgotten before and after each test."""
    sys.modules.pop("model", None)
    yield
    sys.modules.pop("model", None)


def test_a_file_imports_its_siblings(tmp_path, fresh_model, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the config folder
    conf = write_user_files(tmp_path / "conf", "a")
    net = instantiate({"module": "net.py", "type": "make"}, "net", conf)
    model = sys.modules["model"]
    assert Path(model.__file__) == conf / "model.py" and isinstance(net, model.Tiny)
    x = torch.randn(3, 8)
    assert torch.equal(net(x), net.fc(torch.tanh(x[:, 1:])))
    # one stable name, in sys.modules: loading it again is the same module
    loaded = import_module("net.py", "net", conf)
    assert sys.modules[loaded.__name__] is loaded is import_module(str(conf / "net.py"), "x")
    # the folder is not left on sys.path: a dotted name still gets the hint
    assert str(conf) not in sys.path
    with pytest.raises(BuildError, match="write module: net.py"):
        import_module("net", "loss.ce", conf)


def test_a_sibling_loaded_by_path_too_is_one_module(tmp_path, fresh_model):
    conf = write_user_files(tmp_path / "conf", "b")
    import_module("net.py", "net", conf)
    assert import_module("model.py", "net", conf) is sys.modules["model"]


def test_a_sibling_that_is_missing_names_the_file(tmp_path, fresh_model):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "net.py").write_text("from no_such_sibling_e3 import X\n")
    with pytest.raises(BuildError, match="no_such_sibling_e3") as e:
        import_module("net.py", "net", conf)
    assert e.value.key == "net.module" and str(conf / "net.py") in e.value.message


def _compiled_run(folder: Path, tag: str, **extra) -> Path:
    write_user_files(folder, tag)
    probe_config(folder, epochs=1, train_size=8, batch=8, metrics=[])
    edit_yaml(folder / "probe.yaml", lambda cfg: (
        cfg.update(net={"module": "net.py", "type": "make"}, **extra),
        cfg["trainer"]["config"].update(compile=True)))
    return folder


def test_a_net_from_such_a_file_trains_compiled(tmp_path, fresh_model, monkeypatch):
    """Dynamo traces the user's files for real; the eager backend spares the C++ compiler
    (the slow test below runs the default one)."""
    import torch._dynamo

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real(model, backend="eager"))
    torch._dynamo.reset()
    folder = _compiled_run(tmp_path, "c")
    assert echelon3("train", folder, name="probe") == 0
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] >= 1, dict(frames)
    assert (folder / "run" / "best.tar").is_file()


@pytest.mark.slow
def test_a_net_from_such_a_file_trains_compiled_by_inductor_on_two_ranks(tmp_path):
    from tests.conftest import run_cli

    folder = _compiled_run(tmp_path, "d", nproc=2)
    done = run_cli(["train", "-cd", str(folder), "-cn", "probe"], cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "run" / "best.tar").is_file()

"""From module / type / config triples to objects: imports, factories, nesting, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from echelon3.config.build import instantiate, iter_specs
from echelon3.config.errors import BuildError, did_you_mean
from echelon3.config.preflight import check_specs
from echelon3.nets.mlp import MLP
from echelon3.tasks.components import build_optimizer
from tests.test_cli import TINY_RUN, echelon3

# A user's own components, written next to a config.
USER_NETS = '''
from torch import nn


class Tiny(nn.Module):
    def __init__(self, hidden: int, in_features: int = 64, num_classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                    nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.layers(x)


def make_tiny(hidden: int = 8):
    return Tiny(hidden=hidden)


class Box:
    """A container whose arguments may hold components."""

    def __init__(self, left, items=(), named=None, plain=None):
        self.left, self.items, self.named, self.plain = left, items, named, plain


class Lazy:
    """Builds ``inner`` itself, injecting what only it knows."""

    lazy_specs = ("inner",)

    def __init__(self, inner, scale: int = 1):
        from echelon3.config.build import instantiate

        self.raw = inner
        self.inner = instantiate(inner, "lazy.config.inner", in_features=4 * scale)
'''


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    """A config directory with the user's ``my_nets.py`` beside it."""
    root = tmp_path / "conf"
    root.mkdir()
    (root / "my_nets.py").write_text(USER_NETS)
    return root


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch) -> Path:
    """Work from a directory that is not the config directory."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def spec(module: str, type_: str, **config) -> dict:
    return {"module": module, "type": type_, "config": config}


def build_error(*args, **kwargs) -> BuildError:
    with pytest.raises(BuildError) as err:
        instantiate(*args, **kwargs)
    return err.value


# --------------------------------------------------------------------------- end to end


def test_py_file_beside_the_config_and_a_module_in_cwd_train_from_another_directory(
        conf, tmp_path):
    """The real command: ``.py`` next to the config, a factory, a dotted module from cwd."""
    (conf / "tiny.yaml").write_text(TINY_RUN.replace("path: results",
                                                     f"path: {tmp_path / 'results'}"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "cwd_losses.py").write_text(
        "from torch import nn\n\n\nclass Smoothed(nn.CrossEntropyLoss):\n"
        "    def __init__(self, smoothing: float = 0.0):\n"
        "        super().__init__(label_smoothing=smoothing)\n")
    result = echelon3("train", "-cd", "../conf", "-cn", "tiny", "net.module=my_nets.py",
                      "net.type=make_tiny", "net.config={hidden: 12}",
                      "loss.0.ce.module=cwd_losses", "loss.0.ce.type=Smoothed",
                      "+loss.0.ce.config.smoothing=0.1", cwd=work)
    assert result.returncode == 0, result.stderr
    best = tmp_path / "results" / "best.tar"
    assert best.is_file()
    state = torch.load(best, map_location="cpu", weights_only=True)["model_state_dict"]
    assert state["layers.1.weight"].shape == (12, 64)  # Tiny(hidden=12) from make_tiny


# --------------------------------------------------------------------------- module and type


def test_py_file_is_found_beside_the_config_from_another_directory(conf, elsewhere):
    net = instantiate(spec("my_nets.py", "Tiny", hidden=5), "net", conf)
    assert type(net).__name__ == "Tiny"
    assert net.layers[1].out_features == 5


def test_py_file_in_a_subfolder_or_absolute_or_in_cwd(conf, elsewhere):
    (conf / "nets").mkdir()
    (conf / "nets" / "deep.py").write_text(USER_NETS)
    (elsewhere / "here.py").write_text(USER_NETS)
    assert instantiate(spec("nets/deep.py", "make_tiny"), "net", conf).layers[1].out_features == 8
    assert instantiate(spec(str(conf / "my_nets.py"), "make_tiny"), "net").layers[3].in_features \
        == 8
    # not beside the config: the current directory is tried next
    assert type(instantiate(spec("here.py", "make_tiny"), "net", conf)).__name__ == "Tiny"


def test_a_py_file_is_imported_once(conf, elsewhere):
    first = instantiate(spec("my_nets.py", "make_tiny"), "net", conf)
    second = instantiate(spec(str(conf / "my_nets.py"), "Tiny", hidden=3), "net")
    assert type(first) is type(second)


def test_factory_function(elsewhere):
    net = instantiate(spec("echelon3.nets.mlp", "make_mlp", hidden=8, num_classes=3), "net")
    assert isinstance(net, MLP)
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 3)
    assert net.layers[1].out_features == 8


def test_factory_function_names_what_it_accepts(elsewhere):
    err = build_error(spec("echelon3.nets.mlp", "make_mlp", depth=3), "net")
    assert err.key == "net.config.depth"
    assert "make_mlp does not accept 'depth'" in err.message
    assert err.message.endswith("it accepts: hidden, num_classes, in_features")


def test_type_may_be_a_dotted_attribute(elsewhere):
    opt = instantiate(spec("torch", "optim.SGD", lr=0.1), "optimizer",
                      params=[torch.nn.Parameter(torch.zeros(1))])
    assert isinstance(opt, torch.optim.SGD)


def test_omegaconf_nodes_arrive_as_plain_python(conf, elsewhere):
    node = OmegaConf.create(spec("my_nets.py", "Box", left=[1, 2], named={"a": {"b": 1}}))
    box = instantiate(node, "box", conf)
    assert type(box.left) is list and type(box.named) is dict
    assert box.named == {"a": {"b": 1}}


# --------------------------------------------------------------------------- nesting


def test_nested_triples_are_built_recursively(conf, elsewhere):
    linear = spec("torch.nn", "Linear", in_features=2, out_features=3)
    node = OmegaConf.create(spec("my_nets.py", "Box", left=linear,
                                 items=[linear, 5, {"deeper": linear}],
                                 named={"a": linear, "b": "text"},
                                 plain={"module": "only a module key"}))
    box = instantiate(node, "box", conf)
    assert isinstance(box.left, torch.nn.Linear) and box.left.out_features == 3
    assert isinstance(box.items[0], torch.nn.Linear) and box.items[1] == 5
    assert isinstance(box.items[2]["deeper"], torch.nn.Linear)
    assert isinstance(box.named["a"], torch.nn.Linear) and box.named["b"] == "text"
    assert box.plain == {"module": "only a module key"}  # not a triple: left alone


def test_nested_errors_name_the_full_path(conf, elsewhere):
    bad = spec("my_nets.py", "Box", left=1, items=[1, {"deeper": spec("torch.nn", "Linr")}])
    err = build_error(bad, "net", conf)
    assert err.key == "net.config.items[1].deeper.type"
    assert "did you mean 'Linear'" in err.message


def test_lazy_specs_are_handed_over_raw(conf, elsewhere):
    inner = spec("torch.nn", "Linear", out_features=2)
    lazy = instantiate(OmegaConf.create(spec("my_nets.py", "Lazy", inner=inner, scale=2)),
                       "lazy", conf)
    assert type(lazy.raw) is dict and lazy.raw == inner  # plain mapping, not built
    assert isinstance(lazy.inner, torch.nn.Linear) and lazy.inner.in_features == 8


def test_a_lazy_spec_built_by_its_container_finds_files_beside_the_config(conf, elsewhere):
    inner = spec("my_nets.py", "Tiny", hidden=3)  # Lazy injects in_features
    lazy = instantiate(spec("my_nets.py", "Lazy", inner=inner), "lazy", conf)
    assert type(lazy.inner).__name__ == "Tiny" and lazy.inner.layers[1].in_features == 4


def test_an_error_inside_a_container_keeps_its_own_key(conf, elsewhere):
    inner = spec("my_nets.py", "Tiny", hiden=3)
    err = build_error(spec("my_nets.py", "Lazy", inner=inner), "lazy", conf)
    assert err.key == "lazy.config.inner.config.hiden"
    assert "did you mean 'hidden'" in err.message


def test_sam_builds_its_base_optimizer_with_the_parameters(elsewhere):
    from echelon3.optimizers.sam import SAMOptimizer

    net = torch.nn.Linear(2, 1)
    node = OmegaConf.create(spec("echelon3.optimizers.sam", "SAMOptimizer", rho=0.1,
                                 base_optimizer=spec("torch.optim", "SGD", lr=0.5)))
    opt = instantiate(node, "optimizer", params=net.parameters())
    assert isinstance(opt, SAMOptimizer)
    assert isinstance(opt.base_optimizer, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.5


# --------------------------------------------------------------------------- injection


def test_injected_runtime_objects_reach_the_constructor(elsewhere):
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = instantiate(spec("torch.optim", "SGD", lr=0.1), "optimizer", params=params)
    assert opt.param_groups[0]["params"] == params


def test_a_yaml_that_sets_an_injected_name_is_an_error(elsewhere):
    err = build_error(spec("torch.optim", "SGD", lr=0.1, params=[1]), "optimizer",
                      params=[torch.nn.Parameter(torch.zeros(1))])
    assert err.key == "optimizer.config.params"
    assert "supplied by echelon3 at run time" in err.message


def test_the_optimizer_section_injects_params(elsewhere):
    cfg = OmegaConf.create({"optimizer": spec("torch.optim", "AdamW", lr=0.01)})
    opt = build_optimizer(cfg, torch.nn.Linear(2, 2).parameters())
    assert isinstance(opt, torch.optim.AdamW) and len(opt.param_groups[0]["params"]) == 2
    cfg.optimizer.config.params = "x"
    with pytest.raises(BuildError, match="^optimizer.config.params: "):
        build_optimizer(cfg, torch.nn.Linear(2, 2).parameters())


def test_injecting_a_name_the_component_does_not_take(elsewhere):
    err = build_error(spec("echelon3.nets.mlp", "make_mlp"), "data.train", dataset=[])
    assert err.key == "data.train"
    assert "make_mlp does not accept 'dataset'" in err.message
    assert "accepts: hidden, num_classes, in_features" in err.message


# --------------------------------------------------------------------------- errors


def test_unknown_dotted_module(elsewhere):
    err = build_error(spec("echelon3.nets.nope", "MLP"), "net")
    assert err.key == "net.module"
    assert "cannot import 'echelon3.nets.nope' (no module named 'echelon3.nets.nope')" \
        in err.message


def test_dotted_name_of_a_file_beside_the_config_gets_a_hint(conf, elsewhere):
    err = build_error(spec("my_nets", "Tiny"), "net", conf)
    assert err.key == "net.module"
    assert "module: my_nets.py" in err.message


def test_module_whose_own_import_fails(elsewhere, monkeypatch):
    (elsewhere / "needs_dep.py").write_text("import no_such_dependency_e3\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    err = build_error(spec("needs_dep", "X"), "metrics.acc")
    assert err.key == "metrics.acc.module"
    assert "importing 'needs_dep' failed" in err.message
    assert "no_such_dependency_e3" in err.message


def test_py_file_that_fails_to_import(conf, elsewhere):
    (conf / "broken.py").write_text("x = 1 / 0\n")
    err = build_error(spec("broken.py", "X"), "net", conf)
    assert err.key == "net.module"
    assert "ZeroDivisionError" in err.message and "broken.py" in err.message


def test_missing_py_file_lists_where_it_looked(conf, elsewhere):
    err = build_error(spec("gone.py", "X"), "net", conf)
    assert err.key == "net.module"
    assert str(conf / "gone.py") in err.message and str(elsewhere / "gone.py") in err.message


@pytest.mark.parametrize("module", [None, "", 3])
def test_module_must_be_a_name(module):
    err = build_error({"module": module, "type": "X"}, "net")
    assert err.key == "net.module"


def test_unknown_type_suggests_the_closest(elsewhere):
    err = build_error(spec("torch.optim", "Adamw"), "optimizer")
    assert err.key == "optimizer.type"
    assert "'torch.optim' has no attribute 'Adamw' (did you mean 'AdamW'?)" in err.message


def test_suggestions_ignore_case_and_stay_quiet_when_nothing_is_close():
    assert did_you_mean("Adamw", ["Adam", "AdamW"]) == " (did you mean 'AdamW'?)"
    assert did_you_mean("sgd", ["SGD", "ASGD"]) == " (did you mean 'SGD'?)"
    assert did_you_mean("zzz", ["SGD", "AdamW"]) == ""


def test_type_that_is_not_callable(elsewhere):
    err = build_error(spec("math", "pi"), "net")
    assert err.key == "net.type" and "is not a class or function" in err.message


def test_unknown_argument_says_which_and_lists_the_accepted(elsewhere):
    err = build_error(spec("echelon3.nets.mlp", "MLP", hiden=3), "net")
    assert err.key == "net.config.hiden"
    assert "MLP does not accept 'hiden' (did you mean 'hidden'?)" in err.message
    assert "it accepts: in_features, hidden, num_classes, depth, dropout" in err.message


def test_injected_names_are_not_offered(elsewhere):
    err = build_error(spec("torch.optim", "SGD", lr=0.1, momentun=0.9), "optimizer",
                      params=[torch.nn.Parameter(torch.zeros(1))])
    assert err.key == "optimizer.config.momentun"
    assert "(did you mean 'momentum'?)" in err.message
    assert "params" not in err.message.split("it accepts:")[1]


def test_missing_required_argument(elsewhere):
    err = build_error(spec("torch.nn", "Linear", in_features=2), "head")
    assert err.key == "head.config"
    assert "requires 'out_features'" in err.message


def test_constructor_rejecting_a_value_names_the_component(elsewhere):
    err = build_error(spec("echelon3.datasets.digits", "Digits", split="validation"),
                      "data.train")
    assert err.key == "data.train"
    assert "rejected its arguments" in err.message and "validation" in err.message


def test_arguments_pass_through_to_kwargs(elsewhere):
    assert instantiate(spec("builtins", "dict", a=1, b=[2]), "x") == {"a": 1, "b": [2]}


def test_unknown_key_in_a_triple(elsewhere):
    err = build_error({"module": "torch.nn", "type": "ReLU", "confg": {}}, "loss.x")
    assert err.key == "loss.x.confg"
    assert "did you mean 'config'" in err.message
    assert instantiate({"module": "torch.nn", "type": "ReLU", "weight": 2}, "loss.x",
                       extra_keys=("weight",))


def test_not_a_triple(elsewhere):
    err = build_error({"type": "MLP"}, "net")
    assert err.key == "net" and "needs 'module' and 'type'" in err.message


def test_config_must_be_a_mapping(elsewhere):
    err = build_error({"module": "torch.nn", "type": "ReLU", "config": [1]}, "net")
    assert err.key == "net.config"


def test_a_value_left_missing_is_named(elsewhere):
    node = OmegaConf.create({"net": spec("echelon3.nets.mlp", "MLP", hidden="???")})
    err = build_error(node.net, "net")
    assert err.key == "net.config.hidden" and "???" in err.message


def test_errors_chain_the_cause(elsewhere):
    err = build_error(spec("echelon3.nets.nope", "MLP"), "net")
    assert isinstance(err.__cause__, ModuleNotFoundError)


# --------------------------------------------------------------------------- check_specs


def test_every_triple_is_found_with_its_config_path():
    cfg = OmegaConf.create({
        "net": spec("echelon3.nets.mlp", "MLP"),
        "loss": [{"ce": {"module": "torch.nn", "type": "CrossEntropyLoss", "weight": 1}}],
        "optimizer": spec("echelon3.optimizers.sam", "SAMOptimizer",
                          base_optimizer=spec("torch.optim", "SGD")),
        "data": {"test": {"a": spec("x", "Y")}},
        "_mine": spec("nope", "Nope"),
    })
    keys = [k for section, node in cfg.items() for k, _ in iter_specs(node, section)]
    assert keys == ["net", "loss.ce", "optimizer", "optimizer.config.base_optimizer",
                    "data.test.a", "_mine"]


def test_check_specs_finds_a_bad_type_anywhere_before_building(elsewhere):
    cfg = OmegaConf.create({
        "net": spec("echelon3.nets.mlp", "MLP"),
        "optimizer": spec("echelon3.optimizers.sam", "SAMOptimizer",
                          base_optimizer=spec("torch.optim", "SDG")),
        "_mine": spec("nope", "Nope"),  # the user's own: not checked
        "runner": spec("nope", "Nope"),
    })
    with pytest.raises(BuildError) as err:
        check_specs(cfg, skip=("runner",))
    assert err.value.key == "optimizer.config.base_optimizer.type"
    assert "did you mean 'SGD'" in err.value.message
    del cfg.optimizer
    check_specs(cfg, skip=("runner",))
    with pytest.raises(BuildError, match="^runner.module: "):
        check_specs(cfg)


def test_current_directory_on_sys_path_through_the_cli(tmp_path, monkeypatch, capsys):
    """``echelon3`` puts the current directory on sys.path, so dotted user modules import."""
    from echelon3.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "e3_user_net.py").write_text("def make():\n    return 1\n")
    (tmp_path / "run.yaml").write_text(
        "net: {module: e3_user_net, type: Make}\ntarget: {path: out}\ndevice: cpu\n")
    assert main(["train", "-cn", "run", "~target"]) == 2
    err = capsys.readouterr().err
    # imported from the current directory: the type is missing, not the module
    assert "net.type: 'e3_user_net' has no attribute 'Make' (did you mean 'make'?)" in err
    assert str(tmp_path) in sys.path

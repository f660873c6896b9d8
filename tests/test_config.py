"""Config loading: ``defaults:`` composition, overrides, interpolation, ``--print-config``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from echelon3.cli import main
from echelon3.config.compose import ROOT_KEYS, load_config, parse_override
from echelon3.config.errors import ConfigError

ECHELON3 = str(Path(sys.executable).with_name("echelon3")) \
    if Path(sys.executable).with_name("echelon3").exists() else shutil.which("echelon3")

FILES = {
    # The run: root default, a group, a nested group, its own keys last.
    "run.yaml": """
        defaults:
          - base
          - optimizer: sgd
          - data/aug: heavy
          - _self_
        seed: 3
        net:
          module: echelon3.nets.mlp
          type: MLP
          config: {hidden: 16}
        target: {path: "${oc.env:E3_TEST_TARGET,results/default}"}
        """,
    "base.yaml": """
        defaults: [common]
        seed: 1
        net: {config: {hidden: 64, dropout: 0.5}}
        trainer: {config: {epochs: 5}}
        """,
    "common.yaml": "device: cpu\nseed: 0\n",
    "optimizer/sgd.yaml": "module: torch.optim\ntype: SGD\nconfig: {lr: 0.1}\n",
    "optimizer/adamw.yaml": "module: torch.optim\ntype: AdamW\nconfig: {lr: 0.001}\n",
    "data/aug/heavy.yaml": "strength: 9\n",
    "data/aug/light.yaml": "strength: 1\n",
    # A group option that composes a group of its own (looked up inside data/).
    "data/small.yaml": "defaults:\n  - aug: light\nlimit: 5\n",
}


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    root = tmp_path / "conf"
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(line[8:] if line.startswith(" " * 8) else line
                                  for line in text.splitlines()) + "\n")
    return root


def print_config(*args: str, cwd: Path, env: dict | None = None, task: str = "train") -> dict:
    """``echelon3 TASK ARGS --print-config`` through the console script, parsed."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("E3_TEST_",
                                                                         "ECHELON3_"))}
    full_env.update(env or {})
    result = subprocess.run([ECHELON3, task, *args, "--print-config"], cwd=cwd, env=full_env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return yaml.safe_load(result.stdout)


def print_config_here(capsys, *args: str) -> dict:
    """The same through :func:`echelon3.cli.main` in this process (for many small cases)."""
    assert main(["train", *args, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


# --------------------------------------------------------------------------- composition


def test_composition_root_group_nested_group_and_self_last(conf, tmp_path):
    cfg = print_config("-cd", str(conf), "-cn", "run", cwd=tmp_path)
    assert cfg == {
        "device": "cpu",                                   # base -> common (recursive)
        "seed": 3,                                         # own keys win: _self_ is last
        "net": {"module": "echelon3.nets.mlp", "type": "MLP",
                "config": {"hidden": 16, "dropout": 0.5}},  # merged, not replaced
        "trainer": {"config": {"epochs": 5}},
        "optimizer": {"module": "torch.optim", "type": "SGD", "config": {"lr": 0.1}},
        "data": {"aug": {"strength": 9}},                  # data/aug: heavy -> data.aug
        "target": {"path": "results/default"},
    }


def test_self_first_lets_the_defaults_win(conf, tmp_path):
    (conf / "first.yaml").write_text("defaults:\n  - _self_\n  - base\nseed: 3\n")
    cfg = print_config("-cd", str(conf), "-cn", "first", cwd=tmp_path)
    assert cfg["seed"] == 1


def test_self_in_the_middle(conf, tmp_path):
    (conf / "middle.yaml").write_text(
        "defaults:\n  - common\n  - _self_\n  - optimizer: adamw\n"
        "seed: 7\noptimizer: {type: SGD, config: {momentum: 0.9}}\n")
    cfg = print_config("-cd", str(conf), "-cn", "middle", cwd=tmp_path)
    assert cfg["seed"] == 7  # after common
    assert cfg["optimizer"] == {"module": "torch.optim", "type": "AdamW",
                                "config": {"lr": 0.001, "momentum": 0.9}}


def test_self_omitted_means_last(conf, tmp_path):
    (conf / "implicit.yaml").write_text("defaults: [base]\nseed: 4\n")
    cfg = print_config("-cd", str(conf), "-cn", "implicit", cwd=tmp_path)
    assert cfg["seed"] == 4


def test_group_option_composes_its_own_group(conf, tmp_path):
    (conf / "grouped.yaml").write_text("defaults:\n  - data: small\n")
    cfg = print_config("-cd", str(conf), "-cn", "grouped", cwd=tmp_path)
    assert cfg == {"data": {"aug": {"strength": 1}, "limit": 5}}


def test_group_null_selects_nothing_and_slash_means_the_config_dir(conf, tmp_path):
    (conf / "data" / "common.yaml").write_text("limit: 2\n")
    (conf / "data" / "abs.yaml").write_text("defaults:\n  - /common\n  - common\n")
    (conf / "sel.yaml").write_text("defaults:\n  - optimizer: null\n  - data: abs\n")
    cfg = print_config("-cd", str(conf), "-cn", "sel", cwd=tmp_path)
    # /common is the root file, merged at data's level; common is data/common.yaml
    assert cfg == {"data": {"device": "cpu", "seed": 0, "limit": 2}}


def test_config_name_with_or_without_yaml(conf, tmp_path):
    with_suffix = print_config("-cd", str(conf), "-cn", "run.yaml", cwd=tmp_path)
    assert with_suffix == print_config("--config-dir", str(conf), "--config-name", "run",
                                       cwd=tmp_path)


def test_config_dir_defaults_to_the_current_directory(conf, tmp_path):
    assert print_config("-cn", "run", cwd=conf) == print_config("-cd", str(conf), "-cn", "run",
                                                                cwd=tmp_path)
    # a relative -cd is relative to the current directory
    assert print_config("-cd", "conf", "-cn", "run", cwd=tmp_path)["seed"] == 3


@pytest.mark.parametrize("task", ["train", "evaluate", "run"])
def test_print_config_builds_nothing(conf, tmp_path, task):
    target = tmp_path / "never"
    cfg = print_config("-cd", str(conf), "-cn", "run", "net.module=no_such_module",
                       f"target.path={target}", "~optimizer", cwd=tmp_path, task=task)
    assert cfg["net"]["module"] == "no_such_module"
    assert "optimizer" not in cfg
    assert not target.exists()


# --------------------------------------------------------------------------- overrides


def test_every_override_form_through_the_console_script(conf, tmp_path):
    cfg = print_config(
        "-cd", str(conf), "-cn", "run",
        "seed=42",                         # key=value, int
        "net.config.dropout=0.25",         # float
        "+trainer.config.compile=true",    # +key=value, bool
        "++optimizer.config.lr=1e-3",      # ++key=value on an existing key
        "++_notes=hello",                  # ++key=value adding a key
        "gpus=[0,1]",                      # list
        "scheduler=null",                  # null
        "~data",                           # delete a subtree
        "~net.config.hidden",              # delete a leaf
        "hydra.run.dir=outputs",           # Hydra's own: ignored
        "hydra/job_logging=disabled",
        "++hydra.job.chdir=true",
        cwd=tmp_path)
    assert cfg["seed"] == 42
    assert cfg["net"]["config"] == {"dropout": 0.25}
    assert cfg["trainer"]["config"]["compile"] is True
    assert cfg["optimizer"]["config"]["lr"] == 0.001
    assert cfg["_notes"] == "hello"
    assert cfg["gpus"] == [0, 1]
    assert cfg["scheduler"] is None
    assert "data" not in cfg
    assert "hydra" not in cfg


@pytest.mark.parametrize("override,key,expected", [
    ("seed=5", "seed", 5),
    ("seed=-1", "seed", -1),
    ("precision=0.5", "precision", 0.5),
    ("precision=1e-4", "precision", 1e-4),
    ("device=cpu", "device", "cpu"),
    ("device='3'", "device", "3"),          # quoted: stays text
    ("device=\"a b\"", "device", "a b"),
    ("seed=true", "seed", True),
    ("seed=false", "seed", False),
    ("seed=null", "seed", None),
    ("gpus=[0,1]", "gpus", [0, 1]),
    ("gpus=[]", "gpus", []),
    ("gpus=3", "gpus", 3),
    ("_m={a: 1, b: [x, 2]}", "_m", {"a": 1, "b": ["x", 2]}),
    ("seed=a=b", "seed", "a=b"),            # only the first '=' splits
    ("+seed=8", "seed", 8),
    ("++seed=9", "seed", 9),
    ("+net.config.depth=3", "net", {"module": "echelon3.nets.mlp", "type": "MLP",
                                    "config": {"hidden": 16, "dropout": 0.5, "depth": 3}}),
    ("net.config={width: 2}", "net", {"module": "echelon3.nets.mlp", "type": "MLP",
                                      "config": {"width": 2}}),  # '=' replaces, no merge
    ("seed=${net.config.hidden}", "seed", 16),  # interpolation against the whole config
    ("~seed", "seed", "<absent>"),
    ("~net", "net", "<absent>"),
])
def test_override_values_are_typed(conf, capsys, override, key, expected):
    cfg = print_config_here(capsys, "-cd", str(conf), "-cn", "run", override)
    assert cfg.get(key, "<absent>") == expected


def test_list_items_can_be_overridden_and_deleted(conf, capsys):
    cfg = print_config_here(capsys, "-cd", str(conf), "-cn", "run", "gpus=[0,1,2]",
                            "gpus.0=5", "~gpus.1", "+loss=[{ce: {weight: 1}}]",
                            "loss.0.ce.weight=2")
    assert cfg["gpus"] == [5, 2]
    assert cfg["loss"] == [{"ce": {"weight": 2}}]


def test_overrides_apply_in_order(conf, capsys):
    cfg = print_config_here(capsys, "-cd", str(conf), "-cn", "run", "seed=1", "~seed", "seed=2")
    assert cfg["seed"] == 2


def test_env_interpolation_in_yaml_and_overrides(conf, tmp_path):
    cfg = print_config("-cd", str(conf), "-cn", "run", cwd=tmp_path)
    assert cfg["target"]["path"] == "results/default"  # the default when unset
    cfg = print_config("-cd", str(conf), "-cn", "run",
                       "_who=${oc.env:E3_TEST_WHO,nobody}", "_n=${oc.env:E3_TEST_N,0}",
                       cwd=tmp_path, env={"E3_TEST_TARGET": "/data/run1", "E3_TEST_WHO": "me"})
    assert cfg["target"]["path"] == "/data/run1"
    assert cfg["_who"] == "me"
    assert cfg["_n"] == "0"  # oc.env yields text, as in OmegaConf


def test_hydra_keys_in_yaml_and_overrides_are_dropped(conf, capsys):
    (conf / "hy.yaml").write_text("defaults: [run]\nhydra: {run: {dir: outputs}}\n")
    cfg = print_config_here(capsys, "-cd", str(conf), "-cn", "hy", "hydra.verbose=true",
                            "~hydra.run", "hydra/launcher=basic", "+hydra.sweep.dir=x")
    assert "hydra" not in cfg
    assert cfg["seed"] == 3


# --------------------------------------------------------------------------- load_config


def test_load_config_returns_the_resolved_config_and_where_it_came_from(conf, monkeypatch):
    monkeypatch.setenv("E3_TEST_TARGET", "/tmp/t")
    rc = load_config(conf, "run", ["seed=${net.config.hidden}"])
    assert rc.config_dir == conf.resolve()
    assert rc.config_file == conf.resolve() / "run.yaml"
    assert rc.cfg.seed == 16
    assert rc.cfg.target.path == "/tmp/t"
    assert "defaults" not in rc.cfg
    # resolved in place: no interpolation is left for later
    assert "${" not in OmegaConf.to_yaml(rc.cfg)


def test_unknown_root_key_is_an_error_with_a_suggestion(conf):
    with pytest.raises(ConfigError) as err:
        load_config(conf, "run", ["+schedular.type=StepLR"])
    assert err.value.key == "schedular"
    assert "did you mean 'scheduler'" in str(err.value)


def test_an_unknown_root_key_from_the_command_line_is_blamed_on_it(conf):
    with pytest.raises(ConfigError) as err:
        load_config(conf, "run", ["foo.bar=1"])
    assert str(err.value).startswith(
        "foo: unknown root key in override 'foo.bar=1' on the command line;")
    assert "run.yaml" not in str(err.value)


def test_unknown_root_key_in_a_file(conf):
    (conf / "typo.yaml").write_text("defaults: [run]\ndataloader: {}\n")
    with pytest.raises(ConfigError) as err:
        load_config(conf, "typo")
    assert err.value.key == "dataloader"
    assert "typo.yaml" in str(err.value) and "did you mean 'dataloaders'" in str(err.value)


def test_user_keys_and_every_known_root_key_are_accepted(conf):
    overrides = [f"+{k}=null" for k in ROOT_KEYS] + ["+_shared=1", "+__x={a: 2}"]
    rc = load_config(conf, "run", overrides)
    assert rc.cfg._shared == 1
    assert "on_config_change" in ROOT_KEYS  # read by train


def test_cycle_detection_names_the_chain(conf):
    (conf / "optimizer" / "loop.yaml").write_text("defaults: [/cyc]\n")
    (conf / "cyc.yaml").write_text("defaults:\n  - base\n  - optimizer: loop\n")
    with pytest.raises(ConfigError) as err:
        load_config(conf, "cyc")
    assert "loop.yaml: defaults" in err.value.key
    assert "cyc.yaml -> loop.yaml -> cyc.yaml" in str(err.value)


def test_a_file_listed_twice_is_not_a_cycle(conf):
    (conf / "twice.yaml").write_text("defaults: [common, base, common]\n")
    assert load_config(conf, "twice").cfg.seed == 0


@pytest.mark.parametrize("entry,expected", [
    ("override optimizer: sgd", "unsupported defaults form 'override optimizer'"),
    ("optional optimizer: sgd", "unsupported defaults form 'optional optimizer'"),
    ("optimizer@opt: sgd", "unsupported defaults form 'optimizer@opt'"),
    ("base@_global_", "unsupported defaults form 'base@_global_'"),
    ("optimizer: [sgd, adamw]", "option for group 'optimizer' must be a name"),
    ("{a: b, c: d}", "cannot read entry"),
])
def test_unsupported_defaults_forms_are_named(conf, entry, expected):
    (conf / "odd.yaml").write_text(f"defaults:\n  - {entry}\n")
    with pytest.raises(ConfigError) as err:
        load_config(conf, "odd")
    assert err.value.key.endswith("odd.yaml: defaults")
    assert expected in err.value.message


def test_defaults_must_be_a_list(conf):
    (conf / "odd.yaml").write_text("defaults: base\n")
    with pytest.raises(ConfigError, match="odd.yaml: defaults: must be a list"):
        load_config(conf, "odd")


def test_a_list_at_the_top_is_refused(conf):
    (conf / "odd.yaml").write_text("- seed: 1\n")
    with pytest.raises(ConfigError, match="odd.yaml: the top level must be a mapping"):
        load_config(conf, "odd")


def test_an_empty_file_is_an_empty_config(conf):
    (conf / "empty.yaml").write_text("")
    assert dict(load_config(conf, "empty").cfg) == {}


@pytest.mark.parametrize("text,expected", [
    ("seed=1", ("set", "seed", 1)),
    ("+a.b=[1, 2]", ("set", "a.b", [1, 2])),
    ("++a.b-c=x", ("set", "a.b-c", "x")),
    ("~net.config", ("delete", "net.config", None)),
    ("gpus[0]=3", ("set", "gpus[0]", 3)),
    ("x=${oc.env:HOME}", ("set", "x", "${oc.env:HOME}")),  # resolved later, with the config
    ("hydra/launcher=basic", ("set", "hydra/launcher", "basic")),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["seed", "=1", "a..b=1", "+++a=1", "a b=1", "x=[1,",
                                  "~", "1a=2"])
def test_malformed_overrides_name_the_override(text):
    with pytest.raises(ConfigError) as err:
        parse_override(text)
    assert err.value.key == f"override '{text}'"


def test_deleting_a_missing_key_names_it(conf):
    with pytest.raises(ConfigError) as err:
        load_config(conf, "run", ["~net.config.width"])
    assert err.value.key == "net.config.width"
    assert "no such key" in str(err.value)


def test_config_dir_and_name_errors_name_the_option(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "nope", "run")
    assert err.value.key == "--config-dir"
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path, "run")
    assert err.value.key == "--config-name"
    assert str(tmp_path / "run.yaml") in str(err.value)

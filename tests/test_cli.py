"""The ``echelon3`` command: help without torch, exit codes, one-line user errors."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echelon3.cli import main

# The console script installed next to the interpreter running the tests.
ECHELON3 = str(Path(sys.executable).with_name("echelon3")) \
    if Path(sys.executable).with_name("echelon3").exists() else shutil.which("echelon3")

# A complete, tiny training run on the digits (CPU, one epoch, a few batches).
TINY_RUN = """\
seed: 0
device: cpu
net:
  module: echelon3.nets.mlp
  type: MLP
  config: {hidden: 16}
data:
  train: {module: echelon3.datasets.digits, type: Digits, config: {split: train, limit: 64}}
  test: {module: echelon3.datasets.digits, type: Digits, config: {split: test, limit: 32}}
dataloaders:
  train: {module: torch.utils.data, type: DataLoader, config: {batch_size: 16, shuffle: true}}
  test: {module: torch.utils.data, type: DataLoader, config: {batch_size: 32}}
loss:
  - ce: {module: torch.nn, type: CrossEntropyLoss, weight: 1.0}
optimizer: {module: torch.optim, type: SGD, config: {lr: 0.1}}
trainer:
  module: echelon3.trainers.baseline
  type: Trainer
  config: {epochs: 1, progress_bar: false}
target: {path: results, checkpoints_to_keep: 1}
"""


def echelon3(*args: str, cwd: Path, env: dict | None = None, unset: tuple[str, ...] = (),
             timeout: float = 120):
    """Run the real console script; ECHELON3_DEBUG is unset unless ``env`` sets it."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("ECHELON3_DEBUG", *unset)}
    full_env.update(env or {})
    return subprocess.run([ECHELON3, *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def assert_user_error(result, *expected: str) -> str:
    """Exit 2, no traceback, and a last line ``echelon3: error: <key>: ...`` naming ``expected``.

    ``result`` is a finished subprocess or ``(exit code, stderr)`` of an in-process run.
    """
    code, err = (result.returncode, result.stderr) if hasattr(result, "returncode") else result
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("echelon3: error: "), err
    for text in expected:
        assert text in last, f"{text!r} not in {last!r}"
    return last


def in_process(capsys, *args: str) -> tuple[int, str]:
    """``echelon3 ARGS`` run by :func:`echelon3.cli.main` here: (exit code, stderr)."""
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _fresh_log_handler():
    """In-process runs add a stderr handler to the root logger; drop it with capsys's stream."""
    before = list(logging.getLogger().handlers)
    yield
    for handler in logging.getLogger().handlers:
        if handler not in before:
            logging.getLogger().removeHandler(handler)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A config directory holding ``tiny.yaml`` whose results go under tmp_path."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "tiny.yaml").write_text(TINY_RUN.replace("path: results",
                                                     f"path: {tmp_path / 'results'}"))
    return conf


def imported_modules(*args: str, cwd: Path) -> set[str]:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "echelon3", *args],
                            cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    assert "echelon3.cli" in names  # the report was read
    return names


# --------------------------------------------------------------------------- help


def test_top_level_help_lists_the_three_tasks(tmp_path):
    result = echelon3("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for task in ("train", "evaluate", "run"):
        assert task in result.stdout


@pytest.mark.parametrize("task", ["train", "evaluate", "run"])
def test_task_help_shows_options_and_override_forms(task, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([task, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for text in ("--config-dir", "-cd", "--config-name", "-cn", "--print-config",
                 "key=value", "+key=value", "++key=value", "~key", "hydra"):
        assert text in out


def test_train_help_from_the_console_script(tmp_path):
    result = echelon3("train", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--config-name" in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help_imports_no_torch_torchmetrics_or_snakemake(args, tmp_path):
    names = imported_modules(*args, cwd=tmp_path)
    heavy = sorted(n for n in names
                   if n.split(".")[0] in ("torch", "torchmetrics", "snakemake"))
    assert heavy == []


def test_print_config_imports_no_torch(tiny):
    names = imported_modules("train", "-cd", str(tiny), "-cn", "tiny", "--print-config",
                             cwd=tiny)
    assert not [n for n in names if n.split(".")[0] in ("torch", "torchmetrics")]


@pytest.mark.parametrize("args", [[], ["train"], ["fly", "-cn", "x"],
                                  ["train", "-cn", "x", "--no-such-flag"]])
def test_command_line_misuse_exits_2(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert "usage: echelon3" in capsys.readouterr().err


# --------------------------------------------------------------------------- user errors -> 2


def test_missing_config_dir(tmp_path):
    result = echelon3("train", "-cd", "no_such_dir", "-cn", "run", cwd=tmp_path)
    assert_user_error(result, "--config-dir", "no_such_dir")


def test_missing_config_file(tiny):
    result = echelon3("train", "-cd", str(tiny), "-cn", "no_such_run", cwd=tiny)
    assert_user_error(result, "--config-name", "no_such_run.yaml")


def test_missing_file_in_defaults(tiny):
    (tiny / "run.yaml").write_text("defaults:\n  - tiny\n  - optimizer: adamw\n")
    result = echelon3("train", "-cd", str(tiny), "-cn", "run", "--print-config", cwd=tiny)
    assert_user_error(result, "run.yaml", "defaults", "optimizer", "adamw.yaml")


def test_defaults_cycle(tiny):
    (tiny / "a.yaml").write_text("defaults: [b]\nseed: 1\n")
    (tiny / "b.yaml").write_text("defaults: [tiny, a]\n")
    result = echelon3("train", "-cd", str(tiny), "-cn", "a", cwd=tiny)
    assert_user_error(result, "b.yaml", "defaults", "cycle", "a.yaml -> b.yaml -> a.yaml")


@pytest.mark.parametrize("form", ["override optimizer: sgd", "optional optimizer: sgd",
                                  "optimizer@opt: sgd", "tiny@_here_"])
def test_unsupported_defaults_forms(tiny, form):
    (tiny / "run.yaml").write_text(f"defaults:\n  - {form}\n")
    result = echelon3("train", "-cd", str(tiny), "-cn", "run", "--print-config", cwd=tiny)
    assert_user_error(result, "run.yaml", "defaults", "unsupported defaults form",
                      form.split(":")[0])


def test_invalid_yaml_names_file_and_line(tiny):
    (tiny / "bad.yaml").write_text("seed: 1\nnet: [\n")
    result = echelon3("train", "-cd", str(tiny), "-cn", "bad", cwd=tiny)
    assert_user_error(result, "bad.yaml", "not valid YAML", "line")


@pytest.mark.parametrize("override,expected", [
    ("seed", "override 'seed'"),                 # no '='
    ("seed=[1,2", "override 'seed=[1,2'"),       # value does not parse
    ("net..config=1", "override 'net..config=1'"),
    ("=3", "override '=3'"),
    ("+++seed=1", "override '+++seed=1'"),
    ("~no_such_key", "no_such_key"),
])
def test_malformed_override(tiny, override, expected):
    result = echelon3("train", "-cd", str(tiny), "-cn", "tiny", override, cwd=tiny)
    assert_user_error(result, expected)


def test_unknown_root_key_suggests_the_right_one(tiny):
    result = echelon3("train", "-cd", str(tiny), "-cn", "tiny", "optimiser.lr=1", cwd=tiny)
    assert_user_error(result, "optimiser", "did you mean 'optimizer'")


def test_unset_env_var_without_default_names_the_key(tiny):
    result = echelon3("train", "-cd", str(tiny), "-cn", "tiny",
                      "target.path=${oc.env:ECHELON3_TEST_UNSET_VAR}", cwd=tiny,
                      unset=("ECHELON3_TEST_UNSET_VAR",))
    assert_user_error(result, "target.path", "ECHELON3_TEST_UNSET_VAR")


# Errors found while building: run in this process (torch is imported once).

def test_unknown_module(tiny, capsys):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny",
                        "net.module=echelon3.nets.no_such_net")
    assert_user_error(result, "net.module", "echelon3.nets.no_such_net")


def test_missing_py_file_module(tiny, capsys):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny",
                        "net.module=no_such_file.py")
    assert_user_error(result, "net.module", "no_such_file.py", "not found")


def test_unknown_type_suggests_the_right_one(tiny, capsys):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny", "net.type=MPL")
    assert_user_error(result, "net.type", "MPL", "did you mean 'MLP'")
    # the whole of stderr is that one line
    assert result[1].strip().splitlines() == [
        "echelon3: error: net.type: 'echelon3.nets.mlp' has no attribute 'MPL' "
        "(did you mean 'MLP'?)"]


def test_unknown_type_in_a_named_list(tiny, capsys):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny",
                        "loss.0.ce.type=CrossEntropyLos")
    assert_user_error(result, "loss.ce.type", "did you mean 'CrossEntropyLoss'")


def test_constructor_argument_not_accepted(tiny, capsys):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny", "net.config.hiden=8")
    last = assert_user_error(result, "net.config.hiden", "did you mean 'hidden'")
    assert "accepts: in_features, hidden, num_classes, depth, dropout" in last


def test_unknown_key_in_a_component(tiny, capsys):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny",
                        "+optimizer.confg.lr=1")
    assert_user_error(result, "optimizer.confg", "did you mean 'config'")


def test_runtime_object_set_in_yaml(tiny, capsys):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny",
                        "optimizer.config.params=[1]")
    assert_user_error(result, "optimizer.config.params", "supplied by echelon3")


@pytest.mark.parametrize("override,key", [("net.config.hidden=???", "net.config.hidden"),
                                          ("seed=???", "seed")])
def test_value_left_missing(tiny, capsys, override, key):
    result = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny", override)
    assert_user_error(result, f"{key}: has no value", "???")


@pytest.mark.parametrize("task,section", [("train", "net"), ("train", "optimizer"),
                                          ("train", "loss"), ("train", "trainer"),
                                          ("train", "target"), ("evaluate", "net"),
                                          ("run", "net")])
def test_required_section_missing(tiny, capsys, task, section):
    result = in_process(capsys, task, "-cd", str(tiny), "-cn", "tiny", f"~{section}")
    assert_user_error(result, section, "required")


# The real console script, for errors that need torch.

def test_unknown_type_is_reported_before_workers_start(tiny):
    result = echelon3("train", "-cd", str(tiny), "-cn", "tiny", "nproc=2",
                      "optimizer.type=SGDD", cwd=tiny)
    last = assert_user_error(result, "optimizer.type", "did you mean 'SGD'")
    assert result.stderr.count(last) == 1  # reported once, by the launching process
    assert "starting 2 workers" not in result.stderr


def test_gpu_that_does_not_exist_names_gpus(tiny):
    import torch

    missing = torch.cuda.device_count()  # 0 on a CPU-only machine
    result = echelon3("train", "-cd", str(tiny), "-cn", "tiny", "~device", f"gpus=[{missing}]",
                      cwd=tiny)
    assert_user_error(result, "gpus", f"GPU {missing} does not exist")


# --------------------------------------------------------------------------- debug, 1, 130


def test_debug_shows_the_traceback_and_keeps_exit_code_2(tiny, capsys, monkeypatch):
    monkeypatch.setenv("ECHELON3_DEBUG", "1")
    code, err = in_process(capsys, "train", "-cd", str(tiny), "-cn", "tiny", "net.type=MPL")
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert "echelon3.config.errors.BuildError" in err
    assert err.strip().splitlines()[-1].startswith("echelon3: error: net.type:")


def test_debug_shows_the_traceback_of_a_config_error(tmp_path):
    result = echelon3("train", "-cn", "missing", cwd=tmp_path, env={"ECHELON3_DEBUG": "1"})
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError" in result.stderr


def test_other_failures_are_not_hidden(tiny, capsys):
    """Not a user error: main re-raises, so the console script exits 1 with the traceback."""
    (tiny / "broken.py").write_text(
        "def make():\n    raise RuntimeError('a bug in the component')\n")
    with pytest.raises(RuntimeError, match="a bug in the component"):
        main(["train", "-cd", str(tiny), "-cn", "tiny", "net.module=broken.py",
              "net.type=make", "~net.config"])
    assert "echelon3: error" not in capsys.readouterr().err


def test_ctrl_c_exits_130(tiny, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ECHELON3_DEBUG"}
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [ECHELON3, "train", "-cd", str(tiny), "-cn", "tiny", "trainer.config.epochs=100000",
             "data.train.config.limit=null"],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            # The run writes its resolved config just before the loop starts.
            deadline = time.monotonic() + 90
            while not (tmp_path / "results" / "config.yaml").exists() \
                    and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = log.read_text()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "echelon3: interrupted"


def test_a_mistyped_config_name_gets_the_closest_file(tmp_path, capsys):
    for name in ("digits_cnn", "digits_mlp", "other"):
        (tmp_path / f"{name}.yaml").write_text("seed: 0\n")
    last = assert_user_error(in_process(capsys, "train", "-cd", str(tmp_path), "-cn", "digits_cn"))
    assert last == (f"echelon3: error: --config-name: no digits_cn.yaml in {tmp_path} (did you "
                    "mean 'digits_cnn'?); configs there: digits_cnn, digits_mlp, other"), last
    last = assert_user_error(in_process(capsys, "train", "-cd", str(tmp_path), "-cn", "zzz"))
    assert "did you mean" not in last and last.endswith("digits_cnn, digits_mlp, other"), last


@pytest.mark.parametrize("argv,meant", [(["trian"], "train"), (["evalute"], "evaluate"),
                                        (["profiles", "instal"], "install")])
def test_a_mistyped_subcommand_gets_the_closest_one(argv, meant, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "-cd", ".", "-cn", "x"] if len(argv) == 1 else argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].endswith(f"(did you mean '{meant}'?)"), err

"""Values derived in YAML (``${calc:...}``): computed over the run's facts, in one process
and under a 2-process gloo run, and the mistakes named with their key."""

from __future__ import annotations

import json

import pytest
import yaml

from echelon3.config.compose import load_config
from echelon3.config.derived import after_data, derive
from echelon3.config.errors import ConfigError
from tests.conftest import edit_yaml, probe_config, run_cli
from tests.helpers import echelon3

MICRO, MAX_STEPS, ACCUM = 4, 3, 2


def _derive(change):
    """A probe run whose train batch is MICRO per rank, with ``change(cfg)`` applied."""
    def edit(cfg):
        cfg["_micro"] = MICRO
        cfg["dataloaders"]["train"]["config"]["batch_size"] = "${calc:${_micro} * world_size}"
        cfg["trainer"]["config"].update({"max_steps": MAX_STEPS, "grad_accum_steps": ACCUM})
        cfg["data"]["train"]["config"]["size"] = \
            "${calc:max_steps * batch_size * grad_accum_steps}"
        cfg["trainer"]["config"]["val_check_interval"] = "${calc:'(steps_per_epoch + 1) // 2'}"
        change(cfg)
    return edit


@pytest.fixture
def probe_dir(tmp_path):
    probe_config(tmp_path, epochs=None)
    return tmp_path


def _loaded(folder, *overrides):
    return load_config(folder, "probe", overrides).cfg


@pytest.mark.parametrize("world", [1, 2, 3])
def test_values_are_computed_over_the_config_facts(probe_dir, world):
    edit_yaml(probe_dir / "probe.yaml", _derive(lambda cfg: None))
    cfg = _loaded(probe_dir)
    derive(cfg, world)
    batch = MICRO * world
    assert cfg.dataloaders.train.config.batch_size == batch
    assert cfg.data.train.config.size == MAX_STEPS * batch * ACCUM
    # steps_per_epoch waits for the data; then it is the run's own count
    assert cfg.trainer.config.val_check_interval == "${calc:'(steps_per_epoch + 1) // 2'}"
    steps = MAX_STEPS  # the data set holds exactly max_steps windows of accumulation
    built = after_data(cfg, world, steps)
    assert built.trainer.config.val_check_interval == (steps + 1) // 2 == 2
    assert cfg.trainer.config.val_check_interval != 2  # the identity keeps it as written


def test_exact_division_and_total_steps(probe_dir):
    edit_yaml(probe_dir / "probe.yaml", _derive(lambda cfg: cfg["trainer"]["config"].update(
        {"epochs": 5, "log_every_n_steps": "${calc:batch_size / world_size}",
         "val_check_interval": "${calc:total_steps - steps_per_epoch}"})))
    cfg = _loaded(probe_dir)
    derive(cfg, 2)
    assert cfg.trainer.config.log_every_n_steps == MICRO
    built = after_data(cfg, 2, 7)  # 5 epochs of 7 steps, but max_steps comes first
    assert built.trainer.config.val_check_interval == min(5 * 7, MAX_STEPS) - 7


VAL = "trainer.config.val_check_interval"


@pytest.mark.parametrize("overrides, key, message", [
    ([f"{VAL}=${{calc:world_size * nproc}}"], VAL, "names 'nproc', not a fact of the run"),
    ([f"{VAL}=${{calc:'world_size // (world_size - 2)'}}"], VAL,
     "divides by zero for this run (world_size 2)"),
    ([f"{VAL}=${{calc:batch_size / 3}}"], VAL,
     "is not an integer for this run: batch_size / 3 = 8 / 3"),
    ([f"{VAL}=${{calc:'(world_size'}}"], VAL, "cannot read '(world_size'"),
    ([f"{VAL}=${{calc:epochs}}"], VAL,
     "names epochs, which this run does not have (trainer.config.epochs gives none)"),
    (["dataloaders.train.config.batch_size=${calc:batch_size * 2}"],
     "dataloaders.train.config.batch_size", "derived values form a circle: batch_size -> "
     "batch_size"),
    (["trainer.config.max_steps=${calc:batch_size}",
      "dataloaders.train.config.batch_size=${calc:max_steps}"], "trainer.config.max_steps",
     "derived values form a circle: max_steps -> batch_size -> max_steps"),
    (["data.train.config.size=${calc:steps_per_epoch * 8}"], "data.train.config.size",
     "known only once the data is built, after 'data' is"),
    (["trainer.config.grad_accum_steps=${calc:steps_per_epoch}"],
     "trainer.config.grad_accum_steps", "cannot use steps_per_epoch: it is known only once"),
])
def test_mistakes_are_one_line_config_errors_naming_the_key(probe_dir, overrides, key,
                                                            message):
    edit_yaml(probe_dir / "probe.yaml", _derive(lambda cfg: None))
    with pytest.raises(ConfigError) as e:
        derive(_loaded(probe_dir, *overrides), 2)
    assert str(e.value).startswith(f"{key}: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def _check_run(folder, world):
    """What the ranks saw and the config the run wrote, against hand counts."""
    written = yaml.safe_load((folder / "run" / "config.yaml").read_text())
    batch = MICRO * world
    assert written["dataloaders"]["train"]["config"]["batch_size"] == batch
    assert written["data"]["train"]["config"]["size"] == MAX_STEPS * batch * ACCUM
    steps = MAX_STEPS * batch * ACCUM // batch // ACCUM  # samples / global batch / accum
    assert written["trainer"]["config"]["val_check_interval"] == (steps + 1) // 2
    for rank in range(world):
        rows = [json.loads(line) for line in
                (folder / "probe" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [len(r["batch"]) for r in rows] == [MICRO] * (MAX_STEPS * ACCUM)
        assert {r["world"] for r in rows} == {world}


def test_two_processes_derive_from_world_size_2(probe_dir):
    """Through the launcher: the parent computes before spawning, the workers train. The
    network comes from a file beside the config that imports its sibling, as the workers
    load it again (tests/test_user_modules.py)."""
    (probe_dir / "probe_parts.py").write_text("from tests.probe import ProbeNet\n")
    (probe_dir / "probe_net.py").write_text("from probe_parts import ProbeNet\n")

    def edit(cfg):
        cfg.update(nproc=2)
        cfg["net"]["module"] = "probe_net.py"
    edit_yaml(probe_dir / "probe.yaml", _derive(edit))
    done = run_cli(["train", "-cd", str(probe_dir), "-cn", "probe"])
    assert done.returncode == 0, done.stderr[-2000:]
    _check_run(probe_dir, world=2)
    seen = [json.loads(line)["batch"] for rank in (0, 1) for line in
            (probe_dir / "probe" / f"rank{rank}.jsonl").read_text().splitlines()]
    assert sorted(i for batch in seen for i in batch) == list(range(MAX_STEPS * 8 * ACCUM))


def test_a_mistake_stops_the_launcher_before_any_worker(probe_dir, capsys):
    edit_yaml(probe_dir / "probe.yaml", _derive(lambda cfg: cfg.update(nproc=2)))
    code = echelon3("train", probe_dir, "trainer.config.log_every_n_steps="
                    "${calc:'3 // (world_size - 2)'}", name="probe")
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "echelon3: error: trainer.config.log_every_n_steps: '3 // (world_size - 2)' divides "
        "by zero for this run (world_size 2)")
    assert "starting 2 workers" not in err
    assert not (probe_dir / "probe" / "rank0.jsonl").exists()

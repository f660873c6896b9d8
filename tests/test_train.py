"""echelon3.tasks.train: what a refused config change says."""

from __future__ import annotations

from echelon3.config.compose import changed_keys
from tests.helpers import echelon3, write_config


def test_the_config_change_error_lists_the_changed_keys(tmp_path, capsys):
    write_config(tmp_path)
    assert echelon3("train", tmp_path, "trainer.config.epochs=1") == 0
    capsys.readouterr()
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.1", "net.config.hidden=16",
                    "+optimizer.config.nesterov=true") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("echelon3: error: ") and "holds checkpoints of a different config (" \
        in line
    for change in ("net.config.hidden: 32 -> 16", "optimizer.config.lr: 0.05 -> 0.1",
                   "optimizer.config.nesterov: (absent) -> True"):
        assert change in line, line


def test_changed_keys_stays_short():
    old = {f"k{i}": i for i in range(10)}
    new = {f"k{i}": i + 1 for i in range(10)}
    lines = changed_keys(old, new, limit=4)
    assert lines == ["k0: 0 -> 1", "k1: 1 -> 2", "k2: 2 -> 3", "and 7 more"]
    assert changed_keys({"a": {"b": [1]}}, {"a": {"b": [1]}}) == []

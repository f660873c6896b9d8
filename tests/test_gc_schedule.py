"""``trainer.config.gc_every_n_steps``: Python's collector during ``fit`` (the steps it
collects at on two ranks: tests/test_collectives.py)."""

from __future__ import annotations

import gc
import os

import pytest

from echelon3.config.errors import ConfigError
from echelon3.trainers import baseline
from echelon3.trainers.collection import Collection
from tests.helpers import make_trainer


@pytest.fixture(autouse=True)
def unfrozen():
    """A process that exited preempted in this one earlier froze its objects (that is
    ``before_exit``); these tests start from a collector with nothing frozen."""
    gc.unfreeze()
    yield


def _child_status() -> int:
    """0 when a child forked now (a DataLoader worker) collects automatically."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if gc.isenabled() else 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _watch_fit(trainer) -> list[tuple[bool, bool, int]]:
    """(collector on, anything frozen, a forked child's status) at every micro-batch."""
    seen = []
    step = trainer.micro_batch

    def watched(*args, **kwargs):
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0, _child_status()))
        return step(*args, **kwargs)

    trainer.micro_batch = watched
    trainer.fit()
    return seen


def test_fit_turns_the_collector_off_a_fork_gets_it_back_and_it_is_restored(tmp_path,
                                                                             monkeypatch):
    trainer = make_trainer(tmp_path, epochs=1, gc_every_n_steps=2)
    monkeypatch.setattr(baseline, "get_world_size", lambda: 2)  # the schedule is for ranks
    seen = _watch_fit(trainer)
    assert seen and all(s == (False, True, 0) for s in seen)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_one_process_keeps_pythons_own_collector(tmp_path):
    seen = _watch_fit(make_trainer(tmp_path, epochs=1, gc_every_n_steps=2))
    assert seen and all(s == (True, False, 0) for s in seen)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_an_error_in_fit_leaves_the_collector_on(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, epochs=1)
    monkeypatch.setattr(baseline, "get_world_size", lambda: 2)

    def failing(*args, **kwargs):
        raise RuntimeError("boom")

    trainer.micro_batch = failing
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_zero_leaves_pythons_own_collector_and_so_does_one_already_off():
    with Collection(0).during_fit(2):
        assert gc.isenabled() and gc.get_freeze_count() == 0
    with Collection(5).during_fit(1):  # one process: no peers to keep waiting
        assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with Collection(5).during_fit(2):
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_another_freeze_is_kept():
    gc.freeze()
    try:
        with Collection(5).during_fit(2):
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("bad", [-1, 2.5, "50", True])
def test_a_bad_value_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"^trainer\.config\.gc_every_n_steps: must be a whole"):
        Collection(bad)


def test_young_generations_every_n_steps_and_all_of_them_every_tenth_time():
    collected = []

    def record(phase, info):
        if phase == "start":
            collected.append(info["generation"])

    with Collection(2).during_fit(2):
        gc.callbacks.append(record)
        try:
            steps = {}
            for step in range(1, 41):
                before = len(collected)
                Collection(2).after_step(step)
                if len(collected) > before:
                    steps[step] = collected[before:]
        finally:
            gc.callbacks.remove(record)
    assert steps == {s: [2 if s % 20 == 0 else 1] for s in range(2, 41, 2)}

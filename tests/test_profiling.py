"""trainer.config.profile: a torch.profiler trace over a window of batches."""

from __future__ import annotations

import json

import pytest

from echelon3.config.errors import ConfigError
from echelon3.observe.profiler import settings
from tests.helpers import blobs, loader, make_trainer


def trace_names(folder) -> dict[str, int]:
    (path,) = folder.glob("rank0.*.pt.trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    counts: dict[str, int] = {}
    for event in events:
        counts[event.get("name")] = counts.get(event.get("name"), 0) + 1
    return counts


def test_trace_separates_data_wait_compute_and_optimizer_and_the_run_stops(tmp_path):
    profile = {"wait": 1, "warmup": 1, "active": 3, "dir": str(tmp_path / "trace"),
               "stop_after": True}
    trainer = make_trainer(tmp_path, epochs=5, profile=profile,
                           train_loader=loader(*blobs(64), batch_size=8))  # 8 batches/epoch
    trainer.fit()
    assert trainer.global_step == 5  # wait + warmup + active batches, then it stopped
    names = trace_names(tmp_path / "trace")
    for label in ("data_wait", "compute", "optimizer"):
        assert names.get(label) == 3, (label, names)  # one per active batch
    assert sum(1 for n in names if str(n).startswith("ProfilerStep#")) == 3


def test_without_stop_after_the_run_goes_on(tmp_path):
    profile = {"wait": 0, "warmup": 0, "active": 1}
    trainer = make_trainer(tmp_path, epochs=2, profile=profile,
                           train_loader=loader(*blobs(64), batch_size=16))
    trainer.fit()
    assert trainer.global_step == 8
    assert trace_names(tmp_path / "ckpt" / "profile")["compute"] == 1  # default dir


@pytest.mark.parametrize("spec,key", [({"activ": 3}, "profile.activ"),
                                      ({"active": 0}, "profile.active"),
                                      ({"stop_after": "yes"}, "profile.stop_after"),
                                      ([1, 2], "profile")])
def test_bad_profile_settings_name_the_key(spec, key):
    with pytest.raises(ConfigError, match=f"trainer.config.{key}"):
        settings(spec)


def test_with_profiling_autocast_and_ddp_off_no_context_is_entered_per_micro_batch(tmp_path):
    trainer = make_trainer(tmp_path, epochs=1, train_loader=loader(*blobs(64), batch_size=8))
    entered, inside = [], []
    step = trainer.micro_batch

    def watched(*args, **kwargs):
        inside.append(True)
        try:
            return step(*args, **kwargs)
        finally:
            inside.pop()

    def counting(name, real):
        def context(*args, **kwargs):
            if inside:  # validation may autocast: only the training micro-batches count
                entered.append(name)
            return real(*args, **kwargs)
        return context

    trainer.micro_batch = watched
    for owner, name in ((trainer.profiler, "label"), (trainer.precision, "autocast"),
                        (trainer.stepping, "sync")):
        setattr(owner, name, counting(name, getattr(owner, name)))
    trainer.fit()
    assert trainer.global_step == 8 and entered == []

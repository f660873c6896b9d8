"""No silent empty training: an epoch that would make no optimizer step (or never fill a
gradient-accumulation window) stops with exit 2, naming the sizes and the keys, before
the run writes anything."""

from __future__ import annotations

import pytest

from tests.helpers import echelon3, target, write_config


def _left_in(folder):
    """What a failed run left, but the run lock's hidden files (taken over by a rerun)."""
    if not folder.exists():
        return set()
    return {p.name for p in folder.iterdir() if not p.name.startswith(".echelon3.lock")}


@pytest.mark.parametrize("overrides, line", [
    (("data.train.config.limit=5", "dataloaders.train.config.batch_size=8"),
     "dataloaders.train.config.batch_size: an epoch would make no optimizer step: with "
     "dataloaders.train.config.drop_last: true, data.train's 5 samples make no whole batch "
     "of 8; lower the batch size, set drop_last: false, or give more training data"),
    (("+trainer.config.grad_accum_steps=8",),  # 192 samples, batch 32: 6 batches an epoch
     "trainer.config.grad_accum_steps: 8 batches per optimizer step, but an epoch has only 6 "
     "(data.train: 192 samples, dataloaders.train.config.batch_size: 32, drop_last), so no "
     "window is ever full; lower grad_accum_steps or the batch size"),
])
def test_an_epoch_without_an_optimizer_step_is_an_error(tmp_path, capsys, overrides, line):
    write_config(tmp_path)
    out = target(tmp_path)
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # a file that was there before
    assert echelon3("train", tmp_path, *overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"echelon3: error: {line}"
    assert "Traceback" not in "\n".join(err)
    assert _left_in(out) == {"notes.txt"}  # no checkpoint, best.tar, config or summary


def test_an_empty_train_set_is_an_error_without_drop_last(tmp_path, capsys):
    write_config(tmp_path)
    assert echelon3("train", tmp_path, "data.train.config.limit=0",
                    "dataloaders.train.config.drop_last=false") == 2
    assert "data.train has 0 samples" in capsys.readouterr().err
    assert _left_in(target(tmp_path)) == set()


def test_one_partial_batch_without_drop_last_trains(tmp_path):
    write_config(tmp_path, {"trainer": {"config": {"epochs": 1}}})
    assert echelon3("train", tmp_path, "data.train.config.limit=5",
                    "dataloaders.train.config.batch_size=8",
                    "dataloaders.train.config.drop_last=false") == 0
    assert (target(tmp_path) / "summary.json").is_file()

"""Bad data: a sample whose ``__getitem__`` raises, whose shape or dtype differs from its
batch, or whose label lies outside the metric's classes is reported with its index and
its data set's config key, in one line, from the main process, a loader worker or rank 1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.helpers import echelon3, write_config

FAULTS = str(Path(__file__).with_name("faults.py"))
PROMISE = "bad data: the sample's index and config key in one line, any rank, any worker"
DECODE = "sample 5: ValueError: cannot decode this image"
OTHER = r"but sample \d+ of the same batch has"
EXPECTED = {
    "raise": re.escape(DECODE),
    "shape": rf"sample 5: shape \[2, 8, 8\] float32, {OTHER} shape \[1, 8, 8\] float32",
    "dtype": rf"sample 5: shape \[1, 8, 8\] float64, {OTHER} shape \[1, 8, 8\] float32",
    "label": re.escape("sample 5: label 42 is outside the 10 classes (0 to 9) of "
                       "metrics.accuracy"),
}


def _bad(folder: Path, fault: str, split: str, workers: int) -> None:
    bad = {"module": FAULTS, "type": "BadDigits",
           "config": {"fault": fault, "at": 5, "split": split, "limit": 96}}
    write_config(folder, {"data": {split: bad},
                          "dataloaders": {"train": {"config": {"num_workers": workers}},
                                          "test": {"config": {"num_workers": workers}}}},
                 remove=(f"data.{split}",))


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("echelon3:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("fault, split, workers", [
    ("raise", "train", 0), ("raise", "train", 1), ("shape", "train", 1), ("dtype", "train", 0),
    ("label", "train", 0), ("label", "test", 1), ("shape", "test", 0)])
def test_a_bad_sample_is_named_by_index_and_config_key(tmp_path, capfd, ledger, fault, split,
                                                       workers):
    _bad(tmp_path, fault, split, workers)
    assert echelon3("train", tmp_path) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert re.fullmatch(rf"echelon3: error: data\.{split}: {EXPECTED[fault]}", line), line
    ledger(PROMISE, trials=1, faults=1)


def test_a_bad_sample_on_rank_1_in_a_loader_worker(tmp_path, ledger):
    # Evaluation shards by stride: sample 5 belongs to rank 1 of 2.
    _bad(tmp_path, "raise", "test", 1)
    result = run_cli(["train", "-cd", str(tmp_path), "-cn", "run", "nproc=2"], timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"echelon3: error: data.test: {DECODE}" in result.stderr.splitlines()
    ledger(PROMISE, trials=1, faults=1)


@pytest.mark.parametrize("odd", ["dtype", "shape", "length", "kind"])
def test_the_fast_check_of_alike_samples_names_the_same_odd_one_as_the_full_check(odd):
    """The fast check passes only batches the default collate takes unchanged; a shape it
    leaves to the collate's stack, whose refusal is named by the full check."""
    import torch

    from echelon3.data import samples as s

    batch = [(torch.zeros(3), torch.tensor(i)) for i in range(6)]
    batch[4] = {"dtype": (torch.zeros(3, dtype=torch.float64), torch.tensor(4)),
                "shape": (torch.zeros(4), torch.tensor(4)),
                "length": (torch.zeros(3), torch.tensor(4), torch.tensor(0)),
                "kind": [torch.zeros(3), 4]}[odd]
    collate = s.GuardedCollate(None, "data.train")
    assert s._all_alike(batch[:4]) and s._all_alike(batch) == (odd == "shape")
    assert collate._odd_one(batch[:4], list(range(4))) is None
    error = collate._odd_one(batch, list(range(6)))
    full = s._signature(batch[4]), s._signature(batch[0])  # the check without the fast path
    assert full[0] != full[1] and str(error).startswith("data.train: sample 4: "), error
    with pytest.raises(s.DataError) as raised:  # what the loader does with the batch
        collate(batch)
    assert str(raised.value) == str(error)

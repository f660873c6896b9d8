"""The scripts in benchmarks/ run end to end in their small smoke modes (correctness, not
timing: the numbers they print on a loaded test machine mean nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_check, parity, startup, sweep_dag  # noqa: E402


def test_parity_runs_both_loops_to_the_same_loss(capsys):
    assert parity.main(["--smoke", "--runs", "1", "--rows", "5,000 steps", "--no-append"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| tiny MLP, batch 8, 5,"))
    assert "| yes (" in row, out  # fp32, same seed: the same final validation loss
    cells = [c.strip() for c in row.split("|")]
    assert float(cells[4].strip("*")) > 0  # a ratio was measured


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a CPU machine")
def test_parity_reports_gpu_rows_as_no_gpu_without_cuda(capsys):
    assert parity.main(["--smoke", "--rows", "GPU", "--no-append"]) == 0
    out = capsys.readouterr().out
    gpu_rows = [line for line in out.splitlines() if line.startswith("| GPU:")]
    assert len(gpu_rows) == 2 and all("| no GPU |" in line for line in gpu_rows), out


def test_startup_measures_help_a_finished_run_and_the_first_step(capsys):
    assert startup.main(["--smoke", "--runs", "1", "--no-append"]) == 0
    out = capsys.readouterr().out
    assert "`echelon3 --help`" in out and "to its first training step" in out
    assert "`train` of a finished run |" in out  # it exited 0, or main would have raised
    help_row = next(line for line in out.splitlines() if "`echelon3 --help`" in line)
    assert "met" in help_row  # --help imports neither torch nor the tasks


def test_sweep_dag_plans_three_jobs_per_experiment(capsys):
    assert sweep_dag.main(["--sizes", "2", "4", "--repeat", "1", "--no-append"]) == 0
    out = capsys.readouterr().out
    # train, evaluate and run per experiment, plus the report and `all`.
    assert "| 2 | 8 |" in out and "| 4 | 14 |" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a CPU machine")
def test_gpu_check_says_no_gpu_and_its_trainer_path_runs_on_the_cpu(capsys):
    assert gpu_check.main() == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    measured = gpu_check.trainer_steps("cpu", [], smoke=True)
    assert measured["ms"] > 0 and measured["compiles"] == [0, 0, 0]


@pytest.mark.slow
def test_gpt_loop_trains_the_same_gpt_by_hand_and_with_echelon3(capsys):
    from benchmarks import gpt_loop

    assert gpt_loop.main(["--smoke", "--no-append"]) == 0  # 1 and 2 processes
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        assert float(cells[4].strip("*")) > 0 and cells[7] == "yes", row
        hand, ours = cells[6].split(" / ")
        assert abs(float(hand) - float(ours)) <= 1e-4, row  # fp32: the same final loss

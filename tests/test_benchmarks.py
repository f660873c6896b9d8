"""The scripts in benchmarks/ run end to end in their small smoke modes (correctness, not
timing: the numbers they print on a loaded test machine mean nothing)."""

from __future__ import annotations

import sys
import time
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


_BUSY_CHILD = """
import subprocess, sys
code = ("import time\\nwhile time.process_time() < 0.6: pass\\nprint(time.process_time())\\n"
        "time.sleep(0.6)  # busy-child")
print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
"""


def test_process_tree_accounting_matches_the_processes_own_cpu_clock():
    from benchmarks.contention import run_sampled

    done, tree, total = run_sampled([sys.executable, "-c", _BUSY_CHILD], ("busy-child",))
    own = float(done.stdout.split()[0])  # the worker's own CPU clock at the end of its loop
    roles = tree.between(tree.series[0][0], tree.series[-1][0])
    assert roles["worker"]["processes"] == 1 and roles["worker"]["threads"] == 1
    assert abs(roles["worker"]["cpu"] - own) < 0.15, (roles, own)
    assert total >= own + roles["launcher"]["cpu"] - 0.05  # the kernel counts the whole tree


def test_the_hog_burns_every_core_it_is_given_and_ends_with_its_block():
    import psutil

    from benchmarks import contention

    before = set(psutil.Process().children())
    with contention.hog(True, cores=2, limit_s=30):
        busy = set(psutil.Process().children()) - before
        assert len(busy) == 2
        time.sleep(1.5)
        used = [sum(p.cpu_times()[:2]) for p in busy]
    # spinning (an idle interpreter takes ~0.03 s to start), even on a share of a loaded core
    assert all(u > 0.15 for u in used), used
    assert not any(p.is_running() for p in busy)
    with contention.hog(False):
        assert set(psutil.Process().children()) == before


@pytest.mark.slow
def test_parity_ddp_row_trains_all_four_sides_to_the_same_loss(capsys):
    assert parity.main(["--smoke", "--runs", "1", "--rows", "DDP", "--no-append"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| DDP 2 gloo")]
    assert len(rows) == 4 + 4, out  # four sides, then where their CPU went
    assert sum("(same)" in line for line in rows) == 3, out
    assert sum("(vs hand-written" in line for line in rows) == 2, out
    assert "What echelon3 added under contention" in out

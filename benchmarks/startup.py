"""Start-up: what each kind of command costs before (or instead of) its work, against the floor.

    python benchmarks/startup.py [--runs 3] [--smoke] [--no-append]

The floor is ``python -c "import torch, torchmetrics"``: what any training script
pays before its first line of work. Each row is one ``echelon3`` command, at one
process and at ``nproc=2`` (two gloo workers on the CPU), on the shipped
``digits_mlp`` (trained for one epoch first, untimed) unless it says otherwise:

- a config typo (``optimizer.config.lrr``): the pre-flight's one-line error;
- ``train`` of a finished run: nothing to train;
- a refusal the launcher can see: a changed config, ``evaluate`` with no checkpoint;
- ``evaluate`` and ``run`` of the digits test set (whole commands);
- the first training step: from the process start to the first training forward pass
  (``benchmarks.workloads.StampedMLP`` writes the moment down).

The rows run alternately, ``--runs`` times each; the table gives the minimum and the
median, the minimum over the floor, and where the rest goes, as the difference to
the row it builds on: the task's imports (``import echelon3.tasks.train``, the modules
the config names), the pre-flight (typo minus imports), reading the run folder
(finished run minus typo), building and loading (evaluate minus typo), spawning two
workers with their imports and rendezvous (``nproc=2`` minus one process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import append_results  # noqa: E402
from benchmarks.parity import echelon3_config  # noqa: E402
from benchmarks.workloads import workloads  # noqa: E402

PY = sys.executable
FLOOR = [PY, "-c", "import torch, torchmetrics"]
IMPORTS = [PY, "-c", "import echelon3.cli, echelon3.tasks.train, echelon3.nets.mlp, "
           "echelon3.datasets.digits, torchmetrics.classification"]
# row -> (shown as, goal as a multiple of the floor, the row its extra time is counted from)
ROWS = {
    "floor": ('`python -c "import torch, torchmetrics"`', None, None),
    "help": ("`echelon3 --help`", 0.25, None),
    "imports": ("imports of `train` and the config's modules", None, "floor"),
    "typo": ("a config typo's error", 1.5, "imports"),
    "finished": ("`train` of a finished run", 1.5, "typo"),
    "finished_2": ("`train` of a finished run, nproc=2", 1.5, "typo"),
    "changed": ("a changed config refused", 1.5, "typo"),
    "changed_2": ("a changed config refused, nproc=2", 1.5, "typo"),
    "no_checkpoint": ("`evaluate` with no checkpoint", 1.5, "typo"),
    "no_checkpoint_2": ("`evaluate` with no checkpoint, nproc=2", 1.5, "typo"),
    "evaluate": ("`evaluate` of the digits test set", 2.0, "typo"),
    "evaluate_2": ("`evaluate` of the digits test set, nproc=2", 2.0, "evaluate"),
    "run": ("`run` of the digits test set", 2.0, "typo"),
    "run_2": ("`run` of the digits test set, nproc=2", 2.0, "run"),
    "first_step": ("`train` to its first training step", 1.5, "typo"),
    "first_step_2": ("`train` to its first training step, nproc=2", 2.0, "first_step"),
}


def timed(cmd: list[str], env: dict, code: int = 0) -> float:
    start = time.time()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != code:
        raise RuntimeError(f"{cmd} exited {done.returncode}, not {code}:\n{done.stderr[-3000:]}")
    return time.time() - start


SMOKE_ROWS = ("floor", "help", "finished", "first_step")  # what --smoke runs
SMOKE_DATA = ("data.train.config.limit=256", "data.test.config.limit=64")


def echelon3(command: str, work: Path, *overrides: str, smoke: bool = False) -> list[str]:
    return [PY, "-m", "echelon3", command, "-cd", str(REPO / "config" / "experiments"),
            "-cn", "digits_mlp", f"target.path={work}", "device=cpu",
            *(SMOKE_DATA if smoke else ()), *overrides]


def first_step(work: Path, env: dict, smoke: bool, *overrides: str) -> float:
    """Seconds from starting ``echelon3 train`` to its first training forward pass."""
    w = next(iter(workloads(smoke).values()))
    target = work / f"run-{time.monotonic_ns()}"
    cfg = echelon3_config(w, target)
    cfg["net"] = dict(cfg["net"], module="benchmarks.workloads", type="StampedMLP")
    cfg["trainer"]["config"]["epochs"] = 1
    (work / "startup.yaml").write_text(yaml.safe_dump(cfg))
    stamp = work / "first-step"
    stamp.unlink(missing_ok=True)
    start = time.time()
    timed([PY, "-m", "echelon3", "train", "-cd", str(work), "-cn", "startup", *overrides],
          dict(env, FIRST_STEP_FILE=str(stamp)))
    return float(stamp.read_text()) - start


def commands(work: Path, trained: Path, smoke: bool) -> dict:
    """Row -> a function that runs it once and returns its seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")

    def echelon3_(command, folder, *overrides):
        return echelon3(command, folder, *overrides, smoke=smoke)

    two = ("nproc=2",)
    empty = work / "empty"
    rows = {"floor": lambda: timed(FLOOR, env),
            "help": lambda: timed([PY, "-m", "echelon3", "--help"], env),
            "imports": lambda: timed(IMPORTS, env),
            "typo": lambda: timed(echelon3_("train", trained, "optimizer.config.lrr=0.1"),
                                  env, 2)}
    for suffix, more in (("", ()), ("_2", two)):
        rows |= {
            "finished" + suffix: lambda more=more: timed(echelon3_(
                "train", trained, "trainer.config.epochs=1", *more), env),
            "changed" + suffix: lambda more=more: timed(echelon3_(
                "train", trained, "trainer.config.epochs=1", "optimizer.config.lr=0.01",
                *more), env, 2),
            "no_checkpoint" + suffix: lambda more=more: timed(echelon3_(
                "evaluate", empty, *more), env, 2),
            "evaluate" + suffix: lambda more=more: timed(echelon3_(
                "evaluate", trained, *more), env),
            "run" + suffix: lambda more=more: timed(echelon3_("run", trained, *more), env),
            "first_step" + suffix: lambda more=more: first_step(work, env, smoke, *more)}
    return rows, env


def table(times: dict[str, list[float]], runs: int) -> str:
    floor = min(times["floor"])
    lines = ["| what | s (min / median) | min / floor | goal | more than the row before it |",
             "|---|---|---|---|---|"]
    for key, (name, goal, base) in ROWS.items():
        if not times[key]:
            continue
        best = min(times[key])
        verdict = "" if goal is None else (
            f"<= {goal}x: {'met' if best / floor <= goal else 'NOT met'}")
        extra = "" if base is None or not times[base] else f"{best - min(times[base]):+.2f} s over {ROWS[base][0]}"
        lines.append(f"| {name} | {best:.2f} / {statistics.median(times[key]):.2f} "
                     f"| {best / floor:.2f}x | {verdict} | {extra} |")
    lines.append(f"\n{runs} runs of each, alternated; OMP_NUM_THREADS=1.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a small row: a correctness run")
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {key: [] for key in ROWS}
    keys = SMOKE_ROWS if args.smoke else tuple(ROWS)
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        trained = Path(tmp) / "digits"
        rows, env = commands(Path(tmp), trained, args.smoke)
        timed(echelon3("train", trained, "trainer.config.epochs=1", smoke=args.smoke),
              env)  # untimed
        for _ in range(args.runs):
            for key in keys:
                times[key].append(rows[key]())
    text = table(times, args.runs)
    print(text)
    if not args.no_append:
        append_results("startup", text, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

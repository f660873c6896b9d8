"""Start-up: ``echelon3 --help`` and the time to the first training step, against the floor.

    python benchmarks/startup.py [--runs 5] [--no-append]

The floor is ``python -c "import torch, torchmetrics"``: what any training script
pays before its first line of work. ``echelon3 train`` on the tiny MLP row of
``workloads.py`` (epochs=1, on the CPU) is timed from the process start to the
first training forward pass (the network writes the moment down). The three are
run alternately, ``--runs`` times each; the table gives the minimum and median.
Goals: ``--help`` under 1/4 of the floor; the first step within 1.5x of it.
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


def timed(cmd: list[str], env: dict) -> float:
    start = time.time()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{done.stderr[-3000:]}")
    return time.time() - start


def first_step(work: Path, env: dict, smoke: bool) -> float:
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
    timed([sys.executable, "-m", "echelon3", "train", "-cd", str(work), "-cn", "startup"],
          dict(env, FIRST_STEP_FILE=str(stamp)))
    return float(stamp.read_text()) - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a small row: a correctness run")
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    times: dict[str, list[float]] = {"floor": [], "help": [], "first_step": []}
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        for _ in range(args.runs):
            times["floor"].append(timed([sys.executable, "-c", "import torch, torchmetrics"],
                                        env))
            times["help"].append(timed([sys.executable, "-m", "echelon3", "--help"], env))
            times["first_step"].append(first_step(Path(tmp), env, args.smoke))
    floor = min(times["floor"])
    goals = {"floor": None, "help": 0.25, "first_step": 1.5}
    names = {"floor": '`python -c "import torch, torchmetrics"`', "help": "`echelon3 --help`",
             "first_step": "`echelon3 train` to its first training step"}
    lines = ["| what | s (min / median) | min / floor | goal |", "|---|---|---|---|"]
    for key, values in times.items():
        goal = goals[key]
        verdict = "" if goal is None else (
            f"< {goal}x: {'met' if min(values) / floor < goal else 'NOT met'}")
        lines.append(f"| {names[key]} | {min(values):.2f} / {statistics.median(values):.2f} "
                     f"| {min(values) / floor:.2f}x | {verdict} |")
    lines.append(f"\n{args.runs} runs of each, alternated; OMP_NUM_THREADS=1.")
    text = "\n".join(lines)
    print(text)
    if not args.no_append:
        append_results("startup", text, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

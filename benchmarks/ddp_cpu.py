"""Wall time of the digits runs in one process vs 2 gloo ranks (nproc=2), side by side.

Run:  python benchmarks/ddp_cpu.py [--epochs N] [--no-append]
Prints one row per configuration and the ratio against the single process, and
appends the table (dated, with the machine) to ``benchmarks/RESULTS.md``. On a
2-core machine the 2-rank run pays for process start-up and the gradient
all-reduce, so this shows the launcher's overhead rather than a speed-up; the
accuracies show that 2 ranks train the same network as well as one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import append_results  # noqa: E402


def train(name: str, extra: list[str], target: Path, epochs: int) -> tuple[float, float]:
    cli = [sys.executable, "-m", "echelon3"]
    cd = str(REPO / "config" / "experiments")
    args = ["-cd", cd, "-cn", name, "device=cpu", f"target.path={target}",
            f"trainer.config.epochs={epochs}", *extra]
    start = time.perf_counter()
    subprocess.run([*cli, "train", *args], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    subprocess.run([*cli, "evaluate", *args], check=True, capture_output=True)
    accuracy = json.loads((target / "metrics.json").read_text())["accuracy"]
    return seconds, accuracy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    rows = [f"| run | wall s (`echelon3 train`, {args.epochs} epochs) | ratio | test accuracy |",
            "|---|---|---|---|"]
    print(rows[0], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("digits_mlp", "digits_cnn"):
            base = None
            for label, extra in (("1 process", []), ("2 ranks (nproc=2)", ["nproc=2"])):
                seconds, accuracy = train(name, extra, Path(tmp) / f"{name}-{len(extra)}",
                                          args.epochs)
                base = base or seconds
                rows.append(f"| `{name}`, {label} | {seconds:.1f} | {seconds / base:.2f}x | "
                            f"{accuracy:.4f} |")
                print(rows[-1], flush=True)
    if not args.no_append:
        append_results("ddp_cpu", "\n".join(rows), argv)


if __name__ == "__main__":
    main()

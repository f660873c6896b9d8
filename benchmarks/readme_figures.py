"""Measure the figures docs/getting-started.md gives for the embedded default, and write them in.

Runs the shipped workflow (`snakemake -j1`, config/config.yaml as it is) in a
scratch copy of the project, then reads what it left: each run's summary.json
(best epoch, time spent in `echelon3 train` after start-up) and metrics.json
(test accuracy of best.tar). The table between the page's
``<!-- readme_figures:start -->`` and ``<!-- readme_figures:end -->`` markers
is replaced, dated, with the machine's core count and torch version.

    python benchmarks/readme_figures.py            # measure and rewrite the page
    python benchmarks/readme_figures.py --print    # measure and print only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "getting-started.md"
START, END = "<!-- readme_figures:start -->", "<!-- readme_figures:end -->"


def run_workflow(folder: Path) -> tuple[float, float, tuple[float, float]]:
    """`snakemake -j1` on a copy of the project in ``folder``: its wall time and the CPU
    time of everything it ran, in seconds (the CPU time depends less on the load), and
    the machine's 1-minute load average at the start and at the end."""
    shutil.copy2(REPO / "Snakefile", folder / "Snakefile")
    for name in ("workflow", "config", "profiles"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cpu = _children_cpu()
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-j1"], cwd=folder, env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"snakemake -j1 failed:\n{proc.stdout[-4000:]}")
    return elapsed, _children_cpu() - cpu, (load_start, os.getloadavg()[0])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def rows(folder: Path) -> list[str]:
    config = yaml.safe_load((folder / "config/config.yaml").read_text())
    lines = []
    for name in config["experiments"]:
        summary = json.loads((folder / "results" / name / "summary.json").read_text())
        metrics = json.loads((folder / "results" / name / "metrics.json").read_text())
        steps = "max_steps" in summary  # a run counted in steps
        length = f"{summary['steps']} steps" if steps else f"{summary['epochs']} epochs"
        best = f"{summary['best']['epoch']} (step {summary['best']['step']})" if steps \
            else summary["best"]["epoch"]
        lines.append(f"| `{name}` ({length}) | {summary['elapsed_s']:.0f} s "
                     f"| {metrics['accuracy']:.4f} | {best} |")
    return lines


def table(folder: Path, workflow_s: float, cpu_s: float, load: tuple[float, float]) -> str:
    import torch

    header = ["| run | training (`echelon3 train`, after start-up) | test accuracy of best.tar "
              "| best epoch |", "|---|---|---|---|"]
    footer = (f"| `snakemake -j1` (the whole workflow: every job above, evaluate, run, "
              f"export, leaderboard, plots) | {workflow_s:.0f} s in all ({cpu_s:.0f} s of CPU) "
              "| | |")
    note = (f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores (load average "
            f"{load[0]:.1f} at the start, {load[1]:.1f} at the end), torch {torch.__version__}, "
            "by one run of `python benchmarks/readme_figures.py` (it rewrites this table). "
            "Accuracy repeats exactly on the same machine; times vary with its load.")
    return "\n".join([*header, *rows(folder), footer, "", note])


def rewrite(readme: Path, text: str) -> None:
    content = readme.read_text()
    if START not in content or END not in content:
        sys.exit(f"{readme}: no {START} ... {END} markers")
    before, rest = content.split(START, 1)
    _, after = rest.split(END, 1)
    readme.write_text(f"{before}{START}\n{text}\n{END}{after}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the table, leave the page")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="echelon3-figures-") as tmp:
        text = table(Path(tmp), *run_workflow(Path(tmp)))
    print(text)
    if not args.print:
        rewrite(PAGE, text)


if __name__ == "__main__":
    main()

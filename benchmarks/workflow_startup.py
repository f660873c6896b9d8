"""How much of a workflow is start-up: `snakemake -j1` wall time against the time spent training.

Runs `snakemake -j1` in scratch copies of Snakefile, workflow/, config/ and profiles/:

- the default DAG (config/config.yaml as shipped);
- a sweep of 6 small experiments (`digits_mlp`, 2 epochs, a grid of 3 learning rates x 2
  seeds): 18 jobs and the report;
- the same sweep once more with every `train` job forced (`--forcerun train`): runs that
  are finished, as when a parameter that does not change the run retriggers them.

For each: the wall time, the jobs Snakemake ran, the training time (the sum of
`elapsed_s` of every summary.json: `echelon3 train` after its start-up), and what is
left over per job (wall time minus training, over the jobs): the start-up each job pays
(Python, imports, the pre-flight, building) and Snakemake's own work. The table, dated,
with the machine's load, replaces the one between the markers in docs/workflow.md.

    python benchmarks/workflow_startup.py            # measure and rewrite the page
    python benchmarks/workflow_startup.py --print    # measure and print only
    python benchmarks/workflow_startup.py --smoke --print   # 1 sweep point, 1 epoch
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "workflow.md"
START, END = "<!-- workflow_startup:start -->", "<!-- workflow_startup:end -->"


def sweep(points: int, epochs: int) -> dict:
    """The shipped config with one sweep of ``points`` digits_mlp runs and nothing else."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    lrs = [0.1, 0.05, 0.02][:max(1, points // 2)]
    seeds = list(range(max(1, points // len(lrs))))
    cfg["experiments"] = {}
    cfg["sweeps"] = {"small": {"config": "digits_mlp",
                               "overrides": [f"trainer.config.epochs={epochs}"],
                               "grid": {"optimizer.config.lr": lrs, "seed": seeds},
                               "resources": {"gpus": 0, "cpus": 2}}}
    return cfg


def snakemake(folder: Path, *options: str) -> tuple[float, int]:
    """(wall seconds, jobs run) of `snakemake -j1` in ``folder``."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "snakemake", "-j1", *options], cwd=folder,
                          env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"snakemake -j1 {' '.join(options)} failed:\n{done.stdout[-4000:]}")
    counts = re.findall(r"(\d+) of (\d+) steps", done.stdout)
    return wall, int(counts[-1][1]) if counts else 0


def training_s(folder: Path) -> float:
    return sum(json.loads(p.read_text())["elapsed_s"]
               for p in (folder / "results").rglob("summary.json"))


def copy_project(folder: Path, config: dict | None) -> Path:
    folder.mkdir()
    shutil.copy2(REPO / "Snakefile", folder / "Snakefile")
    for name in ("workflow", "config", "profiles"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    if config is not None:
        (folder / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def row(name: str, cold: tuple[float, int, float], warm: tuple[float, int, float]) -> str:
    cells = [name, str(cold[1])]
    for wall, jobs, trained in (cold, warm):
        rest = wall - trained
        cells.append(f"{wall:.0f} s: training {trained:.0f} s ({trained / wall:.0%}), "
                     f"the rest {rest / max(jobs, 1):.1f} s a job")
    cells.append(f"**{warm[0] / cold[0]:.2f}**")
    return "| " + " | ".join(cells) + " |"


def side_by_side(tmp: Path, name: str, config: dict | None, *options: str,
                 folders: dict | None = None) -> tuple:
    """(wall, jobs, training) with warm_start false, then true, each in its own copy
    (``folders``: the copies to reuse, keyed by the setting)."""
    measured = []
    for warm in (False, True):
        folder = (folders or {}).get(warm) or copy_project(tmp / f"{name}-{warm}", config)
        wall, jobs = snakemake(folder, "--config", f"warm_start={warm}", *options)
        measured.append((wall, jobs, training_s(folder)))
        if folders is not None:
            folders[warm] = folder
    return tuple(measured)


def measure(smoke: bool) -> str:
    import torch

    load = os.getloadavg()[0]
    lines = ["| workflow | jobs | `warm_start: false`: wall time, training, the rest | "
             "`warm_start: true` (the default) | **wall time, true / false** |",
             "|---|---|---|---|---|"]
    points, epochs = (1, 1) if smoke else (6, 2)
    with tempfile.TemporaryDirectory(prefix="echelon3-wf-startup-") as tmp:
        tmp = Path(tmp)
        if not smoke:
            lines.append(row("the default DAG (config/config.yaml)",
                             *side_by_side(tmp, "default", None)))
        folders: dict = {}
        config = sweep(points, epochs)
        lines.append(row(f"a sweep of {points} digits_mlp run(s), {epochs} epoch(s) each",
                         *side_by_side(tmp, "sweep", config, folders=folders)))
        # summary.json written again: its elapsed_s is the forced run's training
        lines.append(row("the same sweep, every `train` forced (finished runs)",
                         *side_by_side(tmp, "sweep", config, "--forcerun", "train",
                                       folders=folders)))
    note = (f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores (load average "
            f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), torch "
            f"{torch.__version__}, by `python benchmarks/workflow_startup.py` (it rewrites "
            "this table). Training: the sum of `elapsed_s` over the summary.json files "
            "(`echelon3 train` after its start-up); the rest: wall time minus training, over "
            "the jobs (start-up and Snakemake's own work).")
    return "\n".join([*lines, "", note])


def rewrite(page: Path, text: str) -> None:
    content = page.read_text()
    if START not in content or END not in content:
        sys.exit(f"{page}: no {START} ... {END} markers")
    before, rest = content.split(START, 1)
    _, after = rest.split(END, 1)
    page.write_text(f"{before}{START}\n{text}\n{END}{after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the table, leave the page")
    parser.add_argument("--smoke", action="store_true", help="one sweep point of one epoch")
    args = parser.parse_args(argv)
    text = measure(args.smoke)
    print(text)
    if not args.print:
        rewrite(PAGE, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the finetune/export chain adds to `snakemake -j1` on the embedded default.

Runs the workflow twice in fresh copies of Snakefile, workflow/, config/ and profiles/:
once as shipped, once without the experiments that finetune from another
(`init_from`) — the default before the chain — and prints what the chain adds in
wall time and in CPU time of the jobs (user + system of every process below
Snakemake, which a busy machine inflates far less than wall time), dated, with the
machine's load average at the start and at the end. The total of the whole
workflow on docs/getting-started.md is benchmarks/readme_figures.py's, from one run.

    python benchmarks/workflow_time.py
"""

from __future__ import annotations

import argparse
import datetime
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


def timed_run(config: dict | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the jobs) of `snakemake -j1` in a scratch copy."""
    with tempfile.TemporaryDirectory(prefix="echelon3-wf-") as tmp:
        wf = Path(tmp)
        shutil.copy2(REPO / "Snakefile", wf / "Snakefile")
        for folder in ("workflow", "config", "profiles"):
            shutil.copytree(REPO / folder, wf / folder,
                            ignore=shutil.ignore_patterns("__pycache__"))
        if config is not None:
            (wf / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "snakemake", "-j1", "--quiet"], cwd=wf,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return wall, cpu


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    without = dict(shipped, experiments={name: spec for name, spec in
                                         shipped["experiments"].items()
                                         if "init_from" not in spec})
    chain = sorted(set(shipped["experiments"]) - set(without["experiments"]))
    load = os.getloadavg()[0]
    base, base_cpu = timed_run(without)
    full, full_cpu = timed_run(None)
    print(f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, load average "
          f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end: "
          f"{', '.join(chain)} adds {full - base:.0f} s of wall time and "
          f"{full_cpu - base_cpu:.0f} CPU seconds to `snakemake -j1`")


if __name__ == "__main__":
    main()

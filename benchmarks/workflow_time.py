"""What the finetune/export chain adds to `snakemake -j1` on the embedded default.

Runs the workflow twice in fresh copies of Snakefile, workflow/, config/ and profiles/:
once as shipped, once without the experiments that finetune from another
(`init_from`) — the default before the chain — and prints both wall times and
their difference, and the CPU time the jobs used (user + system of every process
below Snakemake), which a busy machine inflates far less than wall time. With
--write-readme the figures replace the marked line in docs/getting-started.md,
dated, with the machine's load average at the start.

    python benchmarks/workflow_time.py [--write-readme]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
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
MARK = re.compile(r"<!-- workflow-time -->.*?<!-- /workflow-time -->", re.S)


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    without = dict(shipped, experiments={name: spec for name, spec in
                                         shipped["experiments"].items()
                                         if "init_from" not in spec})
    chain = sorted(set(shipped["experiments"]) - set(without["experiments"]))
    load = os.getloadavg()[0]
    base, base_cpu = timed_run(without)
    full, full_cpu = timed_run(None)
    line = (f"<!-- workflow-time -->`benchmarks/workflow_time.py`, "
            f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, load average "
            f"{load:.1f} at the start: `snakemake -j1` took {full:.0f} s for the default and "
            f"{base:.0f} s without {', '.join(chain)}; its jobs used {full_cpu:.0f} and "
            f"{base_cpu:.0f} CPU seconds: the chain adds {full_cpu - base_cpu:.0f} CPU "
            "seconds.<!-- /workflow-time -->")
    print(line)
    if args.write_readme:
        text = PAGE.read_text()
        if not MARK.search(text):
            sys.exit(f"{PAGE} has no <!-- workflow-time --> line to replace")
        PAGE.write_text(MARK.sub(lambda _: line, text))


if __name__ == "__main__":
    main()

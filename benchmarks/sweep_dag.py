"""How long ``snakemake -n`` takes to build the DAG of a sweep of N experiments.

    python benchmarks/sweep_dag.py [--sizes 50 100 200] [--no-append]

A sweep of N points (a grid over the learning rate and the seed) is written as
the workflow's ``config.yaml`` in a copy of the workflow; the dry run is timed
(best of ``--repeat``). Goal: 200 experiments in under 10 s, growing linearly.
The table goes to stdout and, with the machine and command, to RESULTS.md.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import append_results  # noqa: E402

GOAL_S = 10.0


def sweep_config(n: int) -> dict:
    """The shipped config with one sweep of ``n`` points and no other experiment."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    seeds = 10 if n % 10 == 0 else 1
    cfg["experiments"] = {}
    cfg["sweeps"] = {"dag": {
        "config": "digits_mlp", "overrides": [],
        "grid": {"optimizer.config.lr": [round(0.001 * (k + 1), 4) for k in range(n // seeds)],
                 "seed": list(range(seeds))},
        "resources": {"gpus": 0, "cpus": 1}}}
    return cfg


def copy_workflow(into: Path) -> Path:
    for name in ("Snakefile", "workflow", "config", "profiles"):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name)
        elif source.exists():
            shutil.copy(source, into / name)
    return into


def dry_run_seconds(n: int, repeat: int) -> tuple[float, float, int]:
    """Best wall and CPU (user + system) seconds of ``snakemake -n`` over ``repeat`` runs,
    and the jobs it planned. CPU time does not depend on what else loads the machine."""
    with tempfile.TemporaryDirectory(prefix="sweep-dag-") as tmp:
        wf = copy_workflow(Path(tmp))
        (wf / "config" / "config.yaml").write_text(yaml.safe_dump(sweep_config(n)))
        best, cpu, jobs = float("inf"), float("inf"), 0
        for _ in range(repeat):
            start, used = time.perf_counter(), _children_cpu()
            done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--quiet", "rules"],
                                  cwd=wf, capture_output=True, text=True)
            best = min(best, time.perf_counter() - start)
            cpu = min(cpu, _children_cpu() - used)
            if done.returncode != 0:
                raise RuntimeError(f"snakemake -n failed for {n}:\n{done.stderr[-3000:]}")
            jobs = _jobs(done.stdout + done.stderr)
    return best, cpu, jobs


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _jobs(text: str) -> int:
    """The 'total' row of snakemake's job table."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "total" and parts[1].isdigit():
            return int(parts[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    rows = []
    for n in args.sizes:
        seconds, cpu, jobs = dry_run_seconds(n, args.repeat)
        rows.append((n, jobs, seconds, cpu))
        print(f"{n} experiments: {jobs} jobs planned in {seconds:.2f} s ({cpu:.2f} s CPU)",
              flush=True)
    base_n, _, base_s, base_cpu = rows[0]
    lines = [f"| experiments | jobs planned | `snakemake -n` wall s (best of {args.repeat}) "
             f"| CPU s | CPU s per experiment | CPU vs linear from {base_n} |",
             "|---|---|---|---|---|---|"]
    for n, jobs, seconds, cpu in rows:
        lines.append(f"| {n} | {jobs} | {seconds:.2f} | {cpu:.2f} | {cpu / n:.3f} "
                     f"| {cpu / (base_cpu * n / base_n):.2f}x |")
    n, _, wall, cpu = rows[-1]
    verdicts = [f"{what} {value:.2f} s: {'met' if value < GOAL_S else 'NOT met'}"
                for what, value in (("wall", wall), ("CPU", cpu))]
    lines.append(f"\nGoal: {n} experiments in under {GOAL_S:.0f} s; {'; '.join(verdicts)} "
                 "(wall time includes waiting for cores other processes hold).")
    text = "\n".join(lines)
    print(text)
    if not args.no_append:
        append_results("sweep_dag", text, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

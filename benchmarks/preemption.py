"""Signal-to-exit time of a preempted run: how long after SIGTERM / SIGUSR1 it is gone.

Run:  python benchmarks/preemption.py [--repeat N] [--no-write]
Trains digits_mlp on the CPU (one process, 2 ranks through echelon3's launcher, and 2
ranks under torchrun), signals it once its first epoch is checkpointed, and times (a) the
trainer's own figure, signal to mid-epoch checkpoint written, and (b) signal to the exit
of the whole process tree. SLURM kills what is left after KillWait, 30 s by default.
Writes the table into docs/clusters.md (between its `measured: preemption` markers) and
appends it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import REPO, append_results, machine_info  # noqa: E402

PAGE = REPO / "docs" / "clusters.md"  # the page that shows the table
START = "<!-- measured: preemption (python benchmarks/preemption.py) -->"
END = "<!-- end measured: preemption -->"
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
CASES = {  # label -> (launch prefix, extra overrides, signal, to the whole process group)
    "1 process, SIGTERM": ([], [], signal.SIGTERM, True),
    "1 process, SIGUSR1": ([], [], signal.SIGUSR1, True),
    "2 ranks (nproc=2), SIGTERM to the group": ([], ["nproc=2"], signal.SIGTERM, True),
    "2 ranks (nproc=2), SIGUSR1 to the launcher": ([], ["nproc=2"], signal.SIGUSR1, False),
    "2 ranks (torchrun), SIGTERM to the group": (
        ["torchrun", "--standalone", "--nproc_per_node=2", "--no-python"], [],
        signal.SIGTERM, True),
}


def run_once(prefix: list[str], extra: list[str], sig: signal.Signals, group: bool,
             target: Path) -> tuple[float, float]:
    """-> (signal to checkpoint written, as the trainer logged it; signal to exit)."""
    echelon3 = shutil.which("echelon3") or "echelon3"
    cmd = [*prefix, echelon3, "train", "-cd", str(REPO / "config" / "experiments"),
           "-cn", "digits_mlp", "device=cpu", f"target.path={target}",
           "trainer.config.epochs=100", "trainer.config.progress_bar=false", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PET_SIGNALS_TO_HANDLE": TORCHRUN_SIGNALS}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while not (target / "checkpoint-1.tar").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(cmd)}: no epoch finished\n{proc.stderr.read()}")
            time.sleep(0.02)
        sent = time.monotonic()
        (os.killpg if group else os.kill)(proc.pid, sig)
        _, err = proc.communicate(timeout=120)
        gone = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    found = re.search(r"written, ([0-9.]+) s after the signal; exiting 75", err)
    if not found:
        raise SystemExit(f"{' '.join(cmd)}: exit {proc.returncode}, no preemption line\n{err}")
    return float(found.group(1)), gone


def measure(repeat: int) -> str:
    rows = ["| run | signal to checkpoint written (s) | signal to exit (s) |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for label, (prefix, extra, sig, group) in CASES.items():
            times = [run_once(prefix, extra, sig, group, Path(tmp) / f"{len(rows)}-{i}")
                     for i in range(repeat)]
            saved = statistics.median(t[0] for t in times)
            gone = statistics.median(t[1] for t in times)
            rows.append(f"| {label} | {saved:.2f} | {gone:.1f} |")
            print(rows[-1], flush=True)
    return "\n".join(rows)


def write_page(table: str) -> None:
    text = PAGE.read_text()
    pattern = re.compile(re.escape(START) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{PAGE} has no '{START}' ... '{END}' markers")
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    block = (f"{START}\n{table}\n\nMeasured {stamp} by `python benchmarks/preemption.py` "
             f"(median of the runs) on {machine_info()}.\n{END}")
    PAGE.write_text(pattern.sub(lambda _: block, text, count=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (median)")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    args = parser.parse_args()
    table = measure(args.repeat)
    if not args.no_write:
        write_page(table)
        append_results("preemption", table, None)


if __name__ == "__main__":
    main()

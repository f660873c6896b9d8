"""What every benchmark records beside its table: the machine, the date, the exact command."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def machine_info() -> str:
    import torch

    gpu = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
           if torch.cuda.is_available() else "no GPU")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{_cpu_model()}, {os.cpu_count()} CPUs (load {load} at the end), {gpu}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.system()} {platform.release()}; commit {_commit()}")


def append_results(benchmark: str, text: str, argv: list[str] | None,
                   path: Path = RESULTS) -> None:
    """Append one dated section to RESULTS.md."""
    args = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", f"benchmarks/{benchmark}.py", *args])
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if not path.exists():
        path.write_text("# Benchmark results\n\nAppended by the scripts in `benchmarks/`; "
                        "newest last. Never edited by hand.\n")
    with path.open("a") as f:
        f.write(f"\n## {benchmark} — {stamp}\n\n`{command}`\n\n{machine_info()}\n\n{text}\n")

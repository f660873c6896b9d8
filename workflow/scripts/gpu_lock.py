#!/usr/bin/env python3
"""Give a command N GPUs of its own, then run it in this process's place.

    gpu_lock.py N -- COMMAND [ARGS...]

Snakemake counts a `gpu` resource but does not say which GPUs a job may use,
so two jobs running side by side would both pick GPU 0. This script takes an
exclusive lock (flock) on N of the GPUs it can see, sets CUDA_VISIBLE_DEVICES
to them and execs COMMAND, which keeps the locks until it exits; the kernel
drops them when it dies, so a killed job never leaves a GPU taken.

The GPUs it can see: CUDA_VISIBLE_DEVICES when set (a SLURM job's own GPUs,
or a selection made by hand), else those `nvidia-smi` lists. Lock files live
in ECHELON3_GPU_LOCK_DIR (default /tmp/echelon3-gpu-locks), in a subfolder
per SLURM job inside one, because GPU numbers there are the job's own.
When all GPUs are taken it waits for one to come free.

Exit codes: COMMAND's own; 2 when N GPUs cannot be had on this machine.
"""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_LOCK_DIR = "/tmp/echelon3-gpu-locks"
POLL_S = 1.0


def visible_gpus():
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def lock_dir():
    base = Path(os.environ.get("ECHELON3_GPU_LOCK_DIR", DEFAULT_LOCK_DIR))
    job = os.environ.get("SLURM_JOB_ID")
    path = base / f"slurm-{job}" if job else base
    path.mkdir(parents=True, exist_ok=True)
    for folder in {base, path}:
        try:  # shared by every user of the machine, like /tmp
            folder.chmod(0o1777)
        except PermissionError:
            pass
    return path


def try_lock(path):
    """An open, exclusively locked file descriptor, or None if taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def acquire(count, gpus, folder):
    """Lock `count` of `gpus`, waiting while fewer are free."""
    waited = False
    while True:
        held = {}
        for gpu in gpus:
            fd = try_lock(folder / f"gpu-{gpu.replace('/', '_')}.lock")
            if fd is not None:
                held[gpu] = fd
                if len(held) == count:
                    return held
        for fd in held.values():
            os.close(fd)
        if not waited:
            print(f"gpu_lock: waiting for {count} free GPU(s) of {','.join(gpus)}", file=sys.stderr, flush=True)
            waited = True
        time.sleep(POLL_S)


def main(argv):
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: gpu_lock.py N -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    count, command = int(argv[0]), argv[2:]
    gpus = visible_gpus()
    if count < 1 or count > len(gpus):
        print(
            f"gpu_lock: the job asks for {count} GPU(s) but this machine shows {len(gpus)}"
            f" ({','.join(gpus) or 'none'}); lower the experiment's resources.gpus"
            " (0 trains on the CPU)",
            file=sys.stderr,
        )
        return 2
    held = acquire(count, gpus, lock_dir())
    for fd in held.values():
        os.set_inheritable(fd, True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(held)
    print(f"gpu_lock: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}", file=sys.stderr, flush=True)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"gpu_lock: cannot run {command[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Running the Snakemake workflow in tests: a copy of it in a temporary folder,
the real `snakemake` and `echelon3` commands, and readers of their output."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPU_LOCK = REPO / "workflow" / "scripts" / "gpu_lock.py"
SLURM_TOOLS = ("sinfo", "squeue", "sacct", "sacctmgr", "sshare", "scontrol", "scancel")

DRY_S = 120  # one dry run, generous for a loaded 2-core machine
RUN_S = 600  # one real run


def copy_workflow(dest: Path, config: dict | None = None) -> Path:
    """The workflow in `dest`; `config` replaces config/config.yaml when given."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "config", "profiles"):
        shutil.copytree(REPO / folder, dest / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    if config is not None:
        (dest / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


def env_with(**extra) -> dict:
    """This environment without launcher variables (a test run inside a SLURM
    job or torchrun must not look distributed), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def snakemake(cwd: Path, *args: str, timeout: float = DRY_S, env: dict | None = None,
              check: bool = True) -> str:
    """Run snakemake in `cwd`; its stdout and stderr together."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd,
                          env=env or env_with(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    if check and proc.returncode != 0:
        logs = "".join(f"\n--- {p}\n{p.read_text()[-3000:]}" for p in sorted(cwd.glob("logs/**/*.log")))
        raise AssertionError(f"snakemake {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-6000:]}{logs}")
    return proc.stdout


# A job of a dry run: `rule <name>:` and its lines, indented deeper; inside a
# group job's listing (a cluster profile) the whole block is indented.
JOB = re.compile(r"^(?P<indent>[ \t]*)(?:local)?rule (?P<rule>\w+):\n"
                 r"(?P<body>(?:(?P=indent)[ \t]+.*\n)*)", re.M)


def jobs_listed(output: str) -> list[tuple[str, str]]:
    """(rule, its indented lines) of every job a dry run lists."""
    return [(m["rule"], m["body"]) for m in JOB.finditer(output)]


def planned(output: str) -> set[tuple[str, str | None]]:
    """(rule, experiment) of every job a dry run lists."""
    jobs = set()
    for rule, body in jobs_listed(output):
        found = re.search(r"wildcards: exp=([^,\s]+)", body)
        jobs.add((rule, found.group(1) if found else None))
    return jobs


def jobs_for(*experiments: str) -> set[tuple[str, str | None]]:
    per_exp = {(rule, exp) for exp in experiments for rule in ("train", "evaluate", "run")}
    return per_exp | {("report", None), ("all", None)}


# The embedded default's chain: digits_mlp_ft finetunes digits_mlp's best.tar, then exports.
CHAIN = {("finetune", "digits_mlp_ft"), ("evaluate", "digits_mlp_ft"), ("run", "digits_mlp_ft"),
         ("export", "digits_mlp_ft")}


def shell_commands(output: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in output.splitlines()
            if line.startswith("Shell command:")]


def resources_of(output: str, rule: str, exp: str) -> dict[str, str]:
    for name, body in jobs_listed(output):
        if name == rule and f"wildcards: exp={exp}\n" in body:
            line = re.search(r"resources: (.*)", body).group(1)
            return dict(item.split("=", 1) for item in re.split(r", (?=\w+=)", line))
    raise AssertionError(f"no {rule} job for {exp} in:\n{output[-3000:]}")


def descendants(pid: int) -> list[int]:
    """Processes below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"snakemake ended (rc {proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def checkpoint_epochs(folder: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in folder.glob("checkpoint-*.tar")
                  if (m := re.fullmatch(r"checkpoint-(\d+)\.tar", p.name)))


def resumed_epoch(log: Path) -> int:
    found = re.search(r"Resuming from \S*checkpoint-(\d+)\.tar", log.read_text())
    assert found, f"{log} does not resume:\n{log.read_text()[-3000:]}"
    return int(found.group(1))


def experiment(config: str, *overrides: str, **resources) -> dict:
    return {"config": config, "overrides": list(overrides), "resources": {"cpus": 1, **resources}}


def copy_finished(finished: Path, dest: Path) -> Path:
    """A copy of a finished run, metadata and timestamps included."""
    shutil.copytree(finished, dest, symlinks=True)
    return dest


def failing(cwd: Path, *args: str, env: dict | None = None,
            timeout: float = DRY_S) -> subprocess.CompletedProcess:
    """A snakemake run expected to fail: its exit code and console (stdout + stderr)."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd,
                          env=env or env_with(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc

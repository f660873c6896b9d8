"""A real SLURM cluster on this machine for tests (``cluster.sh``): two nodes, each a
network and UTS namespace of its own, where namespaces work; else one node on localhost.

Use the session fixture ``slurm_cluster`` (any number of nodes) or
``slurm_two_nodes`` (skips, naming why, when only one node could be made); both
yield the same :class:`SlurmCluster`, whose ``env`` is a complete environment
for ``subprocess`` calls (sbatch, srun, snakemake, ...). They skip, with the
reason, where SLURM cannot be installed or started here (not root, not Linux,
apt-get failing).

Snakemake's SLURM executor plugin (2.8.0) against this cluster, which has no
accounting and so no working ``sacct``::

    --executor slurm
    --slurm-status-command squeue                # profile: slurm-status-command: squeue
    --slurm-init-seconds-before-status-checks 2  # profile: slurm-init-seconds-before-status-checks: 2
    --slurm-no-account                           # profile: slurm-no-account: true

(:data:`SNAKEMAKE_SLURM_ARGS`). Without the first two the plugin polls with
``sacct`` and hangs forever, even ignoring SIGINT. Snakemake itself must run
with ``SLURM_CONF`` set (``cluster.env``): the plugin reads ``MinJobAge`` with
``scontrol`` and falls back to ``sacct`` when it cannot, or when MinJobAge
(300 s here) is under 3x the init seconds. ``slurm-no-account`` has no effect
in 2.8.0: the plugin still logs "Unable to guess SLURM account" and submits
without ``-A``, which is fine. No partition is needed: the plugin takes the
default one from ``sinfo``. Jobs inherit the submitting environment
(``--export=ALL``), so the interpreter running Snakemake must come first on
``PATH`` (``cluster.env`` does that). Inside a job the plugin's jobstep
executor strips every ``SLURM_*`` variable, ``SLURM_CONF`` too, before its
inner ``srun``; so ``cluster.env`` puts the cluster's client wrappers first on
``PATH`` (``<dir>/bin/srun`` etc., each setting ``SLURM_CONF``), and every
client call of the tests reaches this cluster, inside jobs too, whatever
``/etc/slurm/slurm.conf`` says. Status polls come 2 s after submission, then every +10 s while
nothing finishes, so a two-rule workflow of short jobs takes about 17 s.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import pytest

SCRIPT = Path(__file__).with_name("cluster.sh")

SNAKEMAKE_SLURM_ARGS = (
    "--executor",
    "slurm",
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "2",
    "--slurm-no-account",
)

# Generous: the first bring-up on a fresh machine installs packages.
UP_TIMEOUT_S = 600
DOWN_TIMEOUT_S = 60
COMMAND_TIMEOUT_S = 60

# Exit code of cluster.sh for "SLURM cannot run here" (skip, not fail).
_EXIT_SKIP = 3
# Variables that would make SLURM clients think they run inside another job.
_FOREIGN_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_")


def run_bounded(
    args: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run ``args`` with captured text output; kill its whole process group
    after ``timeout`` seconds and raise ``subprocess.TimeoutExpired`` (with
    the output so far). Unlike ``subprocess.run(timeout=...)`` this also ends
    the grandchildren, which would otherwise keep the pipes open."""
    proc = subprocess.Popen(
        list(args),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def parse_key_values(line: str) -> dict[str, str]:
    """``Key=Value Key2=a=b,c=d`` -> dict. A word without ``Key=`` belongs to
    the previous value (values such as ``Comment`` may hold spaces)."""
    fields: dict[str, str] = {}
    key = None
    for word in line.split():
        match = re.match(r"([A-Za-z][\w:/.]*)=(.*)", word)
        if match:
            key, value = match.groups()
            fields[key] = value
        elif key is not None:
            fields[key] += " " + word
    return fields


def parse_tres(tres: str) -> dict[str, str]:
    """``cpu=2,mem=300M,gres/gpu=1`` -> ``{"cpu": "2", "mem": "300M", ...}``."""
    return dict(item.split("=", 1) for item in tres.split(",") if "=" in item)


@dataclass
class SlurmCluster:
    """A running cluster: its folder, config and client environment."""

    dir: Path
    conf: Path
    env: dict[str, str]
    nodes: list[str]
    one_node_reason: str | None = None

    def run(
        self,
        args: Sequence[str],
        timeout: float = COMMAND_TIMEOUT_S,
        check: bool = True,
        cwd: str | os.PathLike | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a command against the cluster; with ``check`` a non-zero exit
        raises an AssertionError showing its output."""
        result = run_bounded(args, timeout, env=self.env, cwd=cwd)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def scontrol_job(self, jobid: str | int) -> dict[str, str]:
        """``scontrol show job -o JOBID`` as a dict (finished jobs stay
        visible for MinJobAge = 300 s)."""
        out = self.run(["scontrol", "show", "job", "-o", str(jobid)]).stdout
        lines = [line for line in out.splitlines() if line.strip()]
        if not lines:
            raise AssertionError(f"scontrol shows nothing for job {jobid}")
        # An array or heterogeneous job prints one line per component.
        return parse_key_values(lines[0])

    def logs(self) -> str:
        """Tails of the daemon logs, for failure messages."""
        parts = []
        for log in (self.dir / "log/ctld/slurmctld.log",
                    *sorted(self.dir.glob("log/slurmd*.log"))):
            try:
                tail = log.read_text(errors="replace").splitlines()[-40:]
            except OSError as e:
                tail = [f"({e})"]
            parts.append(f"----- {log} -----\n" + "\n".join(tail))
        return "\n".join(parts)


def client_env(conf: Path) -> dict[str, str]:
    """The current environment minus SLURM job variables, plus SLURM_CONF, with the
    cluster's client wrappers (``bin/`` beside ``etc/``: each sets SLURM_CONF itself)
    and this interpreter's folder first on PATH (jobs inherit it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_PREFIXES)}
    env["SLURM_CONF"] = str(conf)
    wrappers = str(conf.parent.parent / "bin")
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([wrappers, bindir, env.get("PATH", "/usr/bin:/bin")])
    return env


def skip_reason() -> str | None:
    """Why SLURM cannot be brought up here, checked before trying; None if
    it may work."""
    if not sys.platform.startswith("linux"):
        return "a local SLURM cluster needs Linux"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (apt-get, mknod, slurmd)"
    if shutil.which("bash") is None:
        return "bash is not available"
    return None


def cluster_up(directory: Path) -> SlurmCluster:
    """``cluster.sh up``; pytest.skip if SLURM cannot run here, AssertionError
    with the daemon logs if it fails to come up."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        result = run_bounded(["bash", str(SCRIPT), "up", str(directory)], UP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"cluster.sh up did not finish in {UP_TIMEOUT_S}s\n{e.stderr}"
        ) from e
    if result.returncode == _EXIT_SKIP:
        lines = result.stderr.strip().splitlines() or ["cluster.sh cannot run here"]
        pytest.skip(lines[-1].replace("cluster.sh: SKIP: ", "local SLURM: "))
    if result.returncode != 0:
        raise AssertionError(
            f"cluster.sh up {directory} exited {result.returncode}\n{result.stderr}"
        )
    conf = Path(directory).resolve() / "etc" / "slurm.conf"
    said = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return SlurmCluster(dir=Path(directory).resolve(), conf=conf, env=client_env(conf),
                        nodes=said["NODES"].split(","),
                        one_node_reason=said.get("ONE_NODE_REASON"))


def cluster_down(directory: Path) -> None:
    """``cluster.sh down``: cancel jobs, stop the daemons."""
    result = run_bounded(["bash", str(SCRIPT), "down", str(directory)], DOWN_TIMEOUT_S)
    if result.returncode != 0:
        raise AssertionError(
            f"cluster.sh down exited {result.returncode}\n{result.stderr}"
        )


class _Shared:
    """One cluster per test process, however many modules register the
    fixture (a conftest import and a test module's own import make two
    fixture definitions): brought up on first use, down after the last."""

    lock = threading.Lock()
    cluster: SlurmCluster | None = None
    users = 0

    @classmethod
    def acquire(cls) -> SlurmCluster:
        with cls.lock:
            if cls.cluster is None:
                directory = Path(tempfile.mkdtemp(prefix="echelon3-slurm-"))
                try:
                    cls.cluster = cluster_up(directory)
                except BaseException:
                    # pytest.skip raises too; leave no daemons and no folder
                    if skip_reason() is None:
                        try:
                            cluster_down(directory)
                        except (AssertionError, subprocess.TimeoutExpired):
                            pass  # the bring-up error is the one to report
                    shutil.rmtree(directory, ignore_errors=True)
                    raise
            cls.users += 1
            return cls.cluster

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users -= 1
            if cls.users > 0 or cls.cluster is None:
                return
            directory, cls.cluster = cls.cluster.dir, None
            try:
                cluster_down(directory)
            finally:
                shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running SLURM cluster (2 fake GPUs per node, default partition
    ``main``) for the whole session; skipped where SLURM cannot run."""
    cluster = _Shared.acquire()
    try:
        yield cluster
    finally:
        _Shared.release()


@pytest.fixture(scope="session")
def slurm_two_nodes(slurm_cluster) -> SlurmCluster:
    """The session's cluster, when it has two nodes; skipped, naming why, when not."""
    if len(slurm_cluster.nodes) < 2:
        pytest.skip(f"a two-node SLURM cluster cannot run here: {slurm_cluster.one_node_reason}")
    return slurm_cluster

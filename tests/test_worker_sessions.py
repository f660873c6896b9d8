"""The built-in launcher's ranks each lead a session of their own, as torchrun's do, and
die with the launcher (echelon3.distributed.launch.own_session).

A session is the kernel's unit of fair CPU sharing under autogroup scheduling: ranks left
in the launching shell's session shared its part with whatever else ran there, and waited
for a core where torchrun's ranks did not (benchmarks/parity.py's DDP rows beside the
CPU hog). Out of the launcher's process group, the ranks must still end when it is
killed, even by SIGKILL, which no relay can pass on.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import echelon3_cmd
from tests.test_dist import _alive, _descendants, _wait_for


def _autogroup(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except OSError:
        return None  # a kernel without autogroup


def test_each_rank_leads_its_own_session_and_dies_with_a_killed_launcher(probe, tmp_path):
    config_dir, write = probe
    write(epochs=1000, net={"sleep": 0.05})
    with open(tmp_path / "launcher.log", "w") as log:
        proc = subprocess.Popen([*echelon3_cmd(), "train", "-cd", str(config_dir), "-cn",
                                 "probe", "nproc=2"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    run: set[int] = set()
    try:
        assert _wait_for(lambda: (config_dir / "probe" / "rank1.jsonl").exists(), 90), \
            (tmp_path / "launcher.log").read_text()[-2000:]
        run = _descendants(proc.pid) | {proc.pid}
        leaders = sorted(pid for pid in run if pid != proc.pid and os.getsid(pid) == pid)
        assert len(leaders) == 2, {pid: os.getsid(pid) for pid in run}  # the two ranks
        groups = {_autogroup(pid) for pid in [proc.pid, *leaders]}
        assert None in groups or len(groups) == 3, groups  # a scheduling group each

        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: nothing relays this one
        assert _wait_for(lambda: not _alive(run), 30), \
            f"left behind: {_alive(run)} of {sorted(run)}"
    finally:
        for pid in _alive(run | {proc.pid}):
            os.kill(pid, signal.SIGKILL)
        proc.wait()

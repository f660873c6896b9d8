"""Two runs, one target: the second refuses at once naming the holder; a lock left by a
killed run is taken over without a word. (Live runs on real processes: test_kill.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from echelon3.checkpoints.lock import LOCK, OWNER, hold
from tests.helpers import echelon3, target, write_config

PROMISE = "two runs, one target: refused at once; a dead run's lock taken over"


def test_a_second_train_on_a_held_target_refuses_at_once_naming_the_holder(tmp_path, capfd,
                                                                          ledger):
    write_config(tmp_path)
    out = target(tmp_path)
    with hold(out):
        start = time.monotonic()
        assert echelon3("train", tmp_path) == 2
        elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("echelon3:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith(f"echelon3: error: target.path: {out} is in use by a running "
                               f"'echelon3 train' (pid {os.getpid()} on {socket.gethostname()}")
    assert elapsed < 10
    assert not list(out.glob("*.tar")) and not (out / "config.yaml").exists()
    ledger(PROMISE, trials=1, faults=1)


def test_the_lock_of_a_killed_run_is_taken_over_silently(tmp_path, capfd, ledger):
    write_config(tmp_path)
    out = target(tmp_path)
    out.mkdir()
    # A process that takes the lock, writes its note and dies by SIGKILL.
    holder = subprocess.run([sys.executable, "-c", (
        "import json, os, signal, sys; from filelock import FileLock\n"
        f"lock = FileLock({str(out / LOCK)!r}, timeout=0); lock.acquire()\n"
        f"open({str(out / OWNER)!r}, 'w').write(json.dumps(dict(pid=os.getpid(), "
        "host='h', started='then')))\n"
        "os.kill(os.getpid(), signal.SIGKILL)")])
    assert holder.returncode == -signal.SIGKILL
    assert json.loads((out / OWNER).read_text())["host"] == "h"
    assert echelon3("train", tmp_path) == 0
    err = capfd.readouterr().err
    assert "in use" not in err and "warn" not in err.lower() and "echelon3: " not in err
    assert (out / "checkpoint-2.tar").exists() and not (out / OWNER).exists()
    ledger(PROMISE, trials=1, faults=1)

"""Ctrl-C: the handler raises only where the exception can travel, and a real
``echelon3 train`` interrupted at random moments exits 130 without a traceback."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from echelon3.distributed import interrupt
from tests.conftest import echelon3_cmd, probe_config

TRIALS_S = 30  # total time for the random interruptions of a real run


@pytest.fixture
def slow_retry(monkeypatch):
    """The retry timer set far out, so that the tests call the retry themselves (a real
    SIGALRM would raise in the middle of pytest)."""
    monkeypatch.setattr(interrupt, "RETRY_S", 60.0)


def _signal_inside_logging() -> None:
    """Run the SIGINT handler as a signal arriving while logging handles a record would."""

    class Arrives(logging.Filter):
        def filter(self, record):
            interrupt._on_sigint(signal.SIGINT, sys._getframe())
            return False

    logger = logging.getLogger("tests.interrupt")
    arrives = Arrives()
    logger.addFilter(arrives)
    try:
        logger.warning("x")
    finally:
        logger.removeFilter(arrives)


def test_a_signal_inside_logging_waits_then_raises_at_a_safe_point(slow_retry):
    with interrupt.handling(keep=False):
        _signal_inside_logging()  # no raise there: logging holds its lock
        assert interrupt.interrupted()
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0  # the retry is armed
        with pytest.raises(KeyboardInterrupt):
            interrupt._on_retry(signal.SIGALRM, sys._getframe())
        interrupt._on_retry(signal.SIGALRM, sys._getframe())  # raised once, never again
        interrupt._on_sigint(signal.SIGINT, sys._getframe())  # a repeat changes nothing


def test_the_loops_raise_of_a_deferred_interrupt_cancels_its_retry(slow_retry):
    """A signal deferred (inside logging) and then raised by the training loop's check
    before the retry came: the retry is cancelled, nothing raises a second time."""
    with interrupt.handling(keep=False):
        _signal_inside_logging()
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
        with pytest.raises(KeyboardInterrupt):
            interrupt.raise_if_interrupted()
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
        interrupt._on_retry(signal.SIGALRM, sys._getframe())  # a late retry: no raise


ARRIVES_AT_IMPORT = ("import signal, sys\n"
                     "from echelon3.distributed import interrupt\n"
                     "interrupt._on_sigint(signal.SIGINT, sys._getframe())\n"
                     "FINISHED = True\n")


def test_a_signal_inside_a_library_import_waits_until_the_import_is_done(
        slow_retry, tmp_path, monkeypatch):
    """An installed library's import (torch's runs C++ initialisers, where a raise aborts
    the process) runs to its end; the user's own module is interrupted at once."""
    library, own = tmp_path / "site-packages", tmp_path / "own"
    for folder, name in ((library, "e3_library_probe"), (own, "e3_own_probe")):
        folder.mkdir()
        (folder / f"{name}.py").write_text(ARRIVES_AT_IMPORT)
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.delitem(sys.modules, name, raising=False)
    with interrupt.handling(keep=False):
        import e3_library_probe  # no raise inside: the import finishes

        assert e3_library_probe.FINISHED and interrupt.interrupted()
        with pytest.raises(KeyboardInterrupt):  # then the retry raises it
            interrupt._on_retry(signal.SIGALRM, sys._getframe())
    with interrupt.handling(keep=False):
        with pytest.raises(KeyboardInterrupt):
            import e3_own_probe  # noqa: F401
    assert "e3_own_probe" not in sys.modules
    monkeypatch.delitem(sys.modules, "e3_library_probe")


class Finalised:
    def __del__(self):
        raise KeyboardInterrupt  # what a signal landing in __del__ amounts to


def test_a_swallowed_interrupt_prints_nothing_and_is_raised_again(slow_retry, capsys):
    with interrupt.handling(keep=False):
        with pytest.raises(KeyboardInterrupt):
            interrupt._on_sigint(signal.SIGINT, sys._getframe())
        Finalised()  # Python reports the exception from __del__ as "unraisable"
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0  # the retry is armed
        with pytest.raises(KeyboardInterrupt):  # the retry (SIGALRM) raises it again
            interrupt._on_retry(signal.SIGALRM, sys._getframe())
    assert "Exception ignored" not in capsys.readouterr().err


def test_after_disarm_a_signal_only_sets_the_flag():
    with interrupt.handling(keep=False):
        interrupt.disarm()
        interrupt._on_sigint(signal.SIGINT, sys._getframe())
        assert interrupt.interrupted()
    assert not interrupt.interrupted()  # the caller's state is back


def test_a_ctrl_c_while_the_interpreter_finishes_is_ignored_by_the_kernel(tmp_path):
    """Finalisation puts a Python-level handler back to the default (which kills with
    SIGINT, exit -2); once main() has its exit code the kernel itself ignores SIGINT."""
    script = ("import os, signal, sys\n"
              "from echelon3.distributed import interrupt\n"
              "with interrupt.handling(keep=True):\n"
              "    pass\n"
              "status = open('/proc/self/status').read()\n"
              "ignored = int(status.split('SigIgn:')[1].split()[0], 16)\n"
              "print(bool(ignored & (1 << (signal.SIGINT - 1))))\n"
              "os.kill(os.getpid(), signal.SIGINT)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "True", "")


def _handler_installed(pid: int) -> bool:
    """echelon3's main() is running: the process catches SIGALRM (the retry timer)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(status.split("SigCgt:")[1].split()[0], 16)
    return bool(caught & (1 << (signal.SIGALRM - 1)))


def _session(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _ctrl_c_after(cmd: list[str], delay: float) -> tuple[int, str, list[int]]:
    """Start ``cmd`` as a terminal would, press Ctrl-C ``delay`` s after its handler is in
    place -> (exit code, stderr, processes of its session still alive 10 s later)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while not _handler_installed(proc.pid) and proc.poll() is None:
            assert time.monotonic() < deadline, "echelon3 never started"
            time.sleep(0.005)
        time.sleep(delay)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        end = time.monotonic() + 10
        while _session(proc.pid) and time.monotonic() < end:
            time.sleep(0.1)
        return proc.returncode, err, _session(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_at_random_moments_never_prints_a_traceback(tmp_path):
    """Seeded moments from start-up through data building, spawning, training and the
    end of the run; one and two processes. Every time: exit 130 (0 when it finished
    first), one line, no traceback, nothing left running."""
    probe_config(tmp_path, epochs=2, net={"sleep": 0.01})
    base = [*echelon3_cmd(), "train", "-cd", str(tmp_path), "-cn", "probe"]
    rng = random.Random(17)
    trials = [(base + ([f"target.path={tmp_path}/run{i}"] + (["nproc=2"] if i % 3 == 2 else [])),
               rng.uniform(0.0, 4.0)) for i in range(12)]
    started, done = time.monotonic(), []
    for cmd, delay in trials:
        if time.monotonic() - started > TRIALS_S:
            break
        code, err, left = _ctrl_c_after(cmd, delay)
        done.append((delay, code))
        where = f"Ctrl-C {delay:.2f} s in ({' '.join(cmd[-2:])}): exit {code}\n{err[-3000:]}"
        assert code in (130, 0), where
        assert "Traceback" not in err and "Exception ignored" not in err, where
        assert code == 0 or err.count("echelon3: interrupted") == 1, where
        assert not left, f"{where}\nleft running: {left}"
    assert len(done) >= 4 and any(code == 130 for _, code in done), done

"""Preemption: stop at a step boundary, write a step-exact checkpoint, exit "resubmit".

SLURM sends SIGTERM on preemption, ``scancel`` and at the wall time (SIGKILL
follows after KillWait, 30 s by default), and, when a job asks for it with
``--signal=USR1@<seconds>``, an early-warning signal that long before the wall
time. echelon3 treats SIGTERM and the early-warning signal (``SIGUSR1``, or
the one named by ``ECHELON3_PREEMPT_SIGNAL``) alike:

1. the handler only notes the signal (no exception lands inside a collective);
2. one process stops after the micro-batch in progress; several ranks agree at
   the trainer's next log point (``log_every_n_steps``): the flag joins the log
   point's one collective, read one log point later, so all stop after the same
   step, even when the signal reached them at different times, and no step
   waits for it. Under DDP, keep a log interval well under the signal's lead
   time (``--signal=USR1@<seconds>``);
3. the trainer writes a mid-epoch checkpoint (rank 0 writes; every rank's part
   of :mod:`echelon3.trainers.state` is in it) and raises :class:`Preempted`;
4. the process exits with :data:`RESUBMIT_EXIT` (75, EX_TEMPFAIL): "try again",
   which the workflow retries; the next attempt resumes at that very step.

Ctrl-C (SIGINT) is no preemption: it keeps raising KeyboardInterrupt (exit 130).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger(__name__)

RESUBMIT_EXIT = 75  # EX_TEMPFAIL: a temporary failure, run again
SIGNAL_ENV = "ECHELON3_PREEMPT_SIGNAL"
DEFAULT_SIGNAL = "SIGUSR1"

_received: str | None = None
_received_at: float | None = None


class Preempted(Exception):
    """The run stopped on a preemption signal after checkpointing; exit with RESUBMIT_EXIT."""

    exit_code = RESUBMIT_EXIT


def _parse(name: str) -> signal.Signals:
    from echelon3.config.errors import ConfigError

    text = name.strip().upper()
    text = text if text.startswith("SIG") else f"SIG{text}"
    sig = getattr(signal.Signals, text, None)
    if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
        raise ConfigError(SIGNAL_ENV, f"must name a signal other than KILL, STOP and INT "
                          f"(e.g. USR1, USR2), got {name!r}")
    return sig


def signals() -> list[signal.Signals]:
    """SIGTERM and the early-warning signal, in that order."""
    import os

    early = _parse(os.environ.get(SIGNAL_ENV) or DEFAULT_SIGNAL)
    return [signal.SIGTERM] + ([early] if early != signal.SIGTERM else [])


def launcher_signals() -> str:
    """What torch elastic's agent should catch and pass on to its workers (it waits
    for them to exit): Ctrl-C and hang-ups as torchrun does, plus ours."""
    names = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    names += [s.name for s in signals() if s.name not in names]
    return ",".join(names)


def _on_signal(signum, frame) -> None:
    global _received, _received_at
    if _received is None:
        _received, _received_at = signal.Signals(signum).name, time.monotonic()


def install() -> None:
    """Note SIGTERM and the early-warning signal instead of dying of them (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for sig in signals():
            signal.signal(sig, _on_signal)


def requested() -> str | None:
    """The name of the preemption signal this process received, if any."""
    return _received


def seconds_since_signal() -> float | None:
    return None if _received_at is None else time.monotonic() - _received_at


def reset() -> None:
    """Forget a received signal (tests, or a process that trains twice)."""
    global _received, _received_at
    _received = _received_at = None


def before_exit() -> None:
    """Called once a preempted run has written everything: leave the objects alive now out
    of the interpreter's final garbage collection, which takes seconds in a process that
    imported torch (and SLURM's KillWait is counting)."""
    import gc

    gc.freeze()


def report(epoch: int, step: int, path) -> str:
    """The line logged once the checkpoint is written."""
    since = seconds_since_signal()
    timing = f", {since:.2f} s after the signal" if since is not None else ""
    return (f"preempted ({_received or 'a signal on another rank'}) at epoch {epoch} "
            f"step {step}: checkpoint {path} written{timing}; exiting {RESUBMIT_EXIT} "
            "(resubmit: the next attempt resumes at this step)")

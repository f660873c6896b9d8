"""Ctrl-C: stop promptly, exit 130, and never print a traceback, wherever the signal lands.

A ``KeyboardInterrupt`` raised by a signal handler appears wherever the main
thread happens to be. In a few places Python cannot pass it on: inside a
``__del__``, a weakref callback or finaliser, logging's at-fork lock hooks.
There it prints ``Exception ignored in ...`` with a traceback, swallows the
exception, and may leave a lock held. An installed library's import is another:
its extension modules run their initialisation from C++, where the exception
aborts the process (torch: ``terminate called after throwing ...``), and a
package cut off half-way cannot be imported again. So the handler here:

1. sets a flag (:func:`interrupted`), which the training loop checks before
   every step and raises at that safe point (:func:`raise_if_interrupted`);
2. raises ``KeyboardInterrupt`` at once only when the interrupted code is not
   one of those places; otherwise it tries again 20 ms later (``SIGALRM``),
   until the main thread is somewhere the exception can travel up from;
3. ignores every later SIGINT (the launcher relays the signal to its workers,
   an impatient user presses Ctrl-C twice): one interruption per process;
4. never raises once :func:`disarm` ran: the command has its exit code and the
   interpreter is finishing (a raise in ``threading._shutdown`` or an atexit
   hook would print a traceback).

Should an interruption still be swallowed somewhere not foreseen, the
unraisable hook keeps it off the screen and arms the retry.

The launcher of local workers does not raise at all: :func:`relay` passes
the signals on to the workers, which stop at their own safe points, and the
launcher reports their exit codes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterable, Iterator

RETRY_S = 0.02
# Code whose frames an exception cannot leave cleanly: called from C with the error
# reported as "unraisable", or holding a lock that a raise would leave held (filelock: its
# fork hooks run around a DataLoader worker's fork, and one cut short breaks the next).
_UNSAFE_MODULES = ("logging", "weakref", "_weakrefset", "atexit", "multiprocessing.util",
                   "filelock", __name__)
_UNSAFE_FUNCTIONS = ("__del__", "_after_fork", "_at_fork_reinit", "_releaseLock", "_acquireLock")
# Where installed libraries live: the import of one of their modules runs to its end.
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")

_interrupted = False
_pending = False  # interrupted, the raise still to come
_armed = False
_next_hook = sys.__unraisablehook__  # the unraisable hook that was there before ours


def interrupted() -> bool:
    """True once Ctrl-C (SIGINT) reached this process."""
    return _interrupted


def raise_if_interrupted() -> None:
    """The training loop's safe point before each step: raise the interruption here, once
    (a retry still armed for it is cancelled, so none follows while the command exits)."""
    global _pending
    if _interrupted:
        if _pending:
            _pending = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        raise KeyboardInterrupt


def _safe(frame) -> bool:
    """Whether a KeyboardInterrupt raised in ``frame`` reaches the caller above it."""
    while frame is not None:
        code = frame.f_code
        module = frame.f_globals.get("__name__", "")
        if code.co_name in _UNSAFE_FUNCTIONS or module.split(".")[0] in _UNSAFE_MODULES \
                or module in _UNSAFE_MODULES:
            return False
        if code.co_name == "<module>" and module != "__main__" \
                and any(part in code.co_filename for part in _LIBRARIES):
            return False  # an import (``python -m library`` runs as __main__)
        frame = frame.f_back
    return True


def _on_sigint(signum, frame) -> None:
    global _interrupted, _pending
    if _interrupted and not _pending:
        return
    _interrupted = True
    if not _armed:
        _pending = False
        return
    if _safe(frame):
        _pending = False
        raise KeyboardInterrupt
    _pending = True
    signal.setitimer(signal.ITIMER_REAL, RETRY_S)  # SIGALRM: try again in a moment


def _on_retry(signum, frame) -> None:
    if _pending:
        _on_sigint(signal.SIGINT, frame)


def _on_unraisable(hook) -> None:
    global _pending
    if isinstance(hook.exc_value, KeyboardInterrupt) and _interrupted:
        if _armed:  # the raise was swallowed: raise again at a safe point
            _pending = True
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
        return
    _next_hook(hook)


def install(unblock: Iterable[signal.Signals] = ()) -> None:
    """Handle SIGINT as above in this process (main thread only; elsewhere a no-op), then
    unblock ``unblock``: a launcher starts its workers with the signals it relays blocked
    (see :func:`relay`), so that none arrives before the handlers do; one sent meanwhile
    stays pending and is delivered now."""
    global _armed, _next_hook
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _on_sigint)
    signal.signal(signal.SIGALRM, _on_retry)
    if sys.unraisablehook is not _on_unraisable:
        _next_hook, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    _armed = True
    signal.pthread_sigmask(signal.SIG_UNBLOCK, list(unblock))


def disarm() -> None:
    """From now on a SIGINT only sets the flag (the command is finishing)."""
    global _armed, _pending
    _armed = _pending = False
    signal.setitimer(signal.ITIMER_REAL, 0)


@contextlib.contextmanager
def handling(keep: bool) -> Iterator[None]:
    """:func:`install` for the body; then :func:`disarm`, and either ignore SIGINT
    (``keep``: the process ends next, its exit code is set) or give the caller its own
    SIGINT handling back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM),
             sys.unraisablehook)
    install()
    try:
        yield
    finally:
        disarm()
        if keep:  # finalisation resets a Python handler to the default, which would kill
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process: ignore it instead
        else:
            signal.signal(signal.SIGINT, saved[0])
            signal.signal(signal.SIGALRM, saved[1])
            sys.unraisablehook = saved[2]
            reset()


def reset() -> None:
    """Forget an interruption (tests, or a process that runs two tasks)."""
    global _interrupted, _pending
    _interrupted = _pending = False


# --------------------------------------------------------------------------- launcher

class Relay:
    """The signals a launcher received, passed on to its workers until they have exited."""

    def __init__(self, workers: Callable[[], Iterable[int]], grace_s: float):
        self.workers = workers
        self.grace_s = grace_s
        self.received: signal.Signals | None = None
        self.killed = False  # workers still alive ``grace_s`` after the signal got SIGKILL
        self._at: float | None = None
        self._done = threading.Event()

    def note(self, signum, frame=None) -> None:
        """The signal handler: note the first signal; pass each one on."""
        sig = signal.Signals(signum)
        if self.received is None:
            self.received, self._at = sig, time.monotonic()
        self._send(sig)

    def _send(self, sig) -> None:
        for pid in self.workers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _watch(self, blocked: list[signal.Signals]) -> None:
        """Receive the signals that all threads block, re-send the first one every half
        second (a worker still starting gets it once its handler is in place) and end
        the workers that outlive the grace period."""
        while not self._done.is_set():
            got = signal.sigtimedwait(blocked, 0.5)
            if got is not None:
                self.note(got.si_signo)
            elif self.received is not None:
                if time.monotonic() - self._at > self.grace_s:
                    self.killed = True
                    self._send(signal.SIGKILL)
                else:
                    self._send(self.received)

    def stop(self) -> None:
        self._done.set()


@contextlib.contextmanager
def relay(sigs: list[signal.Signals], workers: Callable[[], Iterable[int]],
          grace_s: float) -> Iterator[Relay]:
    """While the body runs, this process raises nothing on ``sigs``: each goes on to
    ``workers()`` (pids), repeatedly, and SIGKILL follows ``grace_s`` after the first.
    Processes started inside begin with ``sigs`` blocked."""
    state = Relay(workers, grace_s)
    previous = {sig: signal.signal(sig, state.note) for sig in sigs}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    watcher = threading.Thread(target=state._watch, args=(sigs,), name="echelon3-relay",
                               daemon=True)
    watcher.start()
    try:
        yield state
    finally:
        state.stop()
        watcher.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal still pending lands now
        for sig, handler in previous.items():
            signal.signal(sig, handler)

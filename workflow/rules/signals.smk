"""A signal sent to Snakemake alone reaches the jobs it runs on this machine.

On SIGINT Snakemake 9 says "Terminating processes on user request" and waits
for its local jobs to end; on SIGTERM it waits for them too. A terminal's
Ctrl-C reaches every process of the job anyway, but `kill -INT <pid>` from
another shell, or a scheduler that signals only the main process, leaves
training running to its end (snakemake/snakemake#448 asks for this in
Snakemake itself). So, once the jobs are about to start, Snakemake passes
SIGINT and SIGTERM on to what each job's shell runs, then does what it would
have done: echelon3 stops at its next step (SIGTERM: after a checkpoint, exit
75; SIGINT: exit 130) and the shell ends with it."""

import signal

import psutil


def _pass_on(signum, jobs):
    """Send `signum` to the commands of every job shell in `jobs` (Snakemake's
    children). The shell itself is left alone: bash would die of SIGTERM at once
    and leave its command running; it ends when its command does."""
    for shell in jobs:
        try:
            targets = shell.children(recursive=True) or [shell]
        except psutil.Error:
            continue
        for process in targets:
            try:
                process.send_signal(signum)
            except psutil.Error:
                pass


def _forward_then(previous):
    def handler(signum, frame):
        _pass_on(signum, psutil.Process().children())
        if callable(previous):
            previous(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    return handler


def pass_signals_on_to_local_jobs():
    """Install the handlers after Snakemake's own (onstart runs once its scheduler
    exists), chaining to them. Remote jobs are the executor's to cancel."""
    if not workflow.local_exec:
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _forward_then(signal.getsignal(sig)))


onstart:
    pass_signals_on_to_local_jobs()

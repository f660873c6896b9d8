"""SIGKILL at random instants, the whole run at once, then a rerun to the end: the final
weights equal an uninterrupted run's, ``target.path`` holds no torn or temporary file, no
process of the run survives and no shared-memory segment of it is left in /dev/shm.

Instants are drawn with a fixed seed among three kinds, each planned from the run's observed
progress, never from a clock: during start-up (once the process runs, or after its j-th line
of output, plus at most SLACK seconds), after the k-th history record (plus at most SLACK
seconds), and in the middle of a checkpoint write (made to last DELAY seconds by
slow_fsync/). After each of those events the run has work left that outlasts SLACK (epochs
to train; DELAY > SLACK in every later checkpoint write), so a strike lands on a live run
however slow or loaded the machine (tools/run_slow_tests.sh runs it under a CPU hog). While a run is alive (at
a history record or a checkpoint write) a second claim on its folder must be refused,
naming one of the run's processes: the launcher with the built-in one, rank 0 under torchrun.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from echelon3.checkpoints.lock import RunLocked, hold
from tests.helpers import load, same_nested, write_config
from tests.reliability import kill
from tests.reliability.kill import DELAY, Run

PROMISE = "SIGKILL at any instant: the rerun ends with the uninterrupted weights"
SEED = 20261130
EPOCHS = 3
RECORDS = EPOCHS * 4  # 3 train records (every 2 of 6 steps) and 1 validation per epoch
MODES = {"single": 16, "builtin": 2, "torchrun": 2}  # trials per launcher
DEFAULT_SINGLE = 10  # single-process trials in the default run; the slow set runs all 16
TIMEOUT = 240
SLACK = 0.2  # the most a strike waits after its event (< DELAY)
STARTUP_LINES = 2  # lines every launcher prints before the first step


def _plan(rng: random.Random, trial: int) -> list[tuple]:
    kills = []
    for _ in range(2 if trial % 3 == 2 else 1):  # every third trial is killed twice
        kind = rng.choice(["startup", "records", "records", "write", "write"])
        if kind == "startup":
            kills.append(("startup", rng.randint(0, STARTUP_LINES),
                          round(rng.uniform(0, SLACK), 2)))
        elif kind == "records":
            kills.append(("records", rng.randint(1, RECORDS - 2),
                          round(rng.uniform(0, SLACK), 2)))
        else:
            kills.append(("write", round(rng.uniform(0.05, 0.9) * DELAY, 3)))
    return kills


def _plans() -> list[tuple[str, int, list[tuple]]]:
    rng = random.Random(SEED)
    return [(mode, trial, _plan(rng, trial))
            for mode, count in MODES.items() for trial in range(count)]


def _config(folder: Path, mode: str) -> Path:
    workers = 1 if mode == "single" else 0  # loader workers share batches through /dev/shm
    write_config(folder, {"trainer": {"config": {"epochs": EPOCHS}},
                          "dataloaders": {"train": {"config": {"num_workers": workers}}}})
    return folder / "out"


@pytest.fixture(scope="module")
def ctx():
    return kill.forkserver()


@pytest.fixture(scope="module")
def references(tmp_path_factory, ctx):
    """Final state of one uninterrupted run per world size (torchrun and the built-in
    launcher start the same 2 gloo ranks from the same seeds)."""
    found = {}
    for mode in ("single", "builtin"):
        folder = tmp_path_factory.mktemp(f"reference-{mode}")
        out = _config(folder, mode)
        run = Run(mode, folder, folder / "log.txt", ctx)
        assert run.wait(TIMEOUT) == 0, run.output()
        found[mode] = load(out / f"checkpoint-{EPOCHS}.tar")
    found["torchrun"] = found["builtin"]
    return found


def _history_lines(out: Path) -> int:
    try:
        return len((out / "history.jsonl").read_bytes().splitlines())
    except OSError:
        return 0


def _writing(out: Path) -> bool:
    return out.is_dir() and any(p.name.endswith(".tmp") and ".tar." in p.name
                                for p in out.iterdir())


def _wait_until(run: Run, condition, limit: float = TIMEOUT) -> bool:
    end = time.monotonic() + limit
    while run.running() and time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return False


def _probe_lock(run: Run, out: Path) -> bool | None:
    """A second claim on a live run's folder is refused, naming a process of the run."""
    if not run.running():
        return None
    try:
        with hold(out):
            return None  # the run ended in between: nothing to refuse
    except RunLocked as e:
        pid = int(str(e).split("(pid ")[1].split()[0])
        assert pid in run.seen | run.processes(), str(e)
        return True


def _strike(run: Run, out: Path, plan: tuple) -> tuple[bool, bool | None]:
    """Kill ``run`` as ``plan`` says; (killed, lock refused) -- not killed if it ended first."""
    kind, *args = plan
    refused = None
    if kind == "startup":
        hit = _wait_until(run, lambda: len(run.output().splitlines()) >= args[0])
        time.sleep(args[1])
    elif kind == "records":
        hit = _wait_until(run, lambda: _history_lines(out) >= args[0])
        refused = _probe_lock(run, out) if hit else None
        time.sleep(args[1])
    else:
        hit = _wait_until(run, lambda: _writing(out))
        refused = _probe_lock(run, out) if hit else None
        time.sleep(args[0])
    if not run.running():
        return False, refused
    run.kill()
    return True, refused


def _check_folder(out: Path) -> None:
    names = sorted(p.name for p in out.iterdir())
    assert not [n for n in names if n.endswith((".tmp", ".link"))], names
    assert ".echelon3.lock.owner" not in names, names
    for path in out.glob("*.tar"):
        load(path)  # raises on a torn file
    for line in (out / "history.jsonl").read_text().splitlines():
        json.loads(line)


def _params():
    return [pytest.param(mode, trial, plan, id=f"{mode}-{trial}",
                         marks=[pytest.mark.slow] if mode == "single" and
                         trial >= DEFAULT_SINGLE else [])
            for mode, trial, plan in _plans()]


@pytest.mark.parametrize("mode, trial, plan", _params())
def test_killed_at_random_instants_then_rerun(tmp_path, ctx, references, ledger, mode, trial,
                                              plan):
    out = _config(tmp_path, mode)
    shm_before = kill.shm_names()
    kills, refusals, seen = 0, 0, set()
    for attempt, strike in enumerate(plan):
        run = Run(mode, tmp_path, tmp_path / f"log-{attempt}.txt", ctx)
        killed, refused = _strike(run, out, strike)
        run.wait(TIMEOUT)
        seen |= run.seen  # the killed attempts' processes
        kills += killed
        refusals += bool(refused)
        assert run.survivors() == [], f"survived the kill ({strike})"
    final = Run(mode, tmp_path, tmp_path / "log-final.txt", ctx)
    assert final.wait(TIMEOUT) == 0, final.output()
    assert "Traceback" not in final.output()
    assert final.survivors() == []
    assert kills >= 1, f"every planned instant came after the run's end: {plan}"
    state = load(out / f"checkpoint-{EPOCHS}.tar")
    reference = references[mode]
    assert state["global_step"] == reference["global_step"]
    assert same_nested(state["model_state_dict"], reference["model_state_dict"])
    assert same_nested(state["optimizer_state_dict"], reference["optimizer_state_dict"])
    _check_folder(out)
    # A run that ends cleanly leaves no shared-memory segment. A SIGKILL that lands inside
    # torch's creation of one (between shm_open and its shm_unlink, a few system calls)
    # can leave that one behind: at most one per killed process, removed here.
    assert kill.leaked_shm(shm_before, final.seen) == []
    left = kill.leaked_shm(shm_before, seen)
    creators = Counter(name.split("_")[1] for name in left)
    for name in left:
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert all(count == 1 for count in creators.values()), left
    ledger(PROMISE, trials=1, faults=kills)
    if refusals:
        ledger("two runs, one target: refused at once; a dead run's lock taken over",
               trials=refusals, faults=refusals)


def _hog(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@pytest.mark.slow
def test_every_planned_strike_lands_on_a_live_run_under_a_cpu_hog(tmp_path, ctx):
    """The test of the test: 20 plans of the kinds above, each struck at a run while a busy
    loop holds every core; none may come after the run's end."""
    import multiprocessing

    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_hog, args=(stop,), daemon=True)
            for _ in range(os.cpu_count() or 2)]
    for hog in hogs:
        hog.start()
    rng = random.Random(SEED + 1)
    missed = []
    try:
        for trial in range(20):
            folder = tmp_path / f"trial-{trial}"
            out = _config(folder, "single")
            strike = _plan(rng, 0)[0]
            run = Run("single", folder, folder / "log.txt", ctx)
            killed, _ = _strike(run, out, strike)
            run.wait(TIMEOUT)
            if not killed:
                missed.append(strike)
    finally:
        stop.set()
        for hog in hogs:
            hog.join(10)
    assert not missed, f"struck after the run's end: {missed}"

"""Faults on purpose. Every test here records what it tried in the ledger; when the whole
folder ran and passed, the session's end writes the ledger to RELIABILITY.md, so the
figures there always come from the last full, green run and never from a hand."""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO

HERE = Path(__file__).resolve().parent
REPORT = REPO / "RELIABILITY.md"


@dataclass
class Entry:
    promise: str
    test: str
    trials: int = 0
    faults: int = 0
    inputs: int = 0
    lost: int = 0
    seconds: float = 0.0


@dataclass
class Ledger:
    entries: dict[tuple[str, str], Entry] = field(default_factory=dict)
    tests: dict[str, Entry] = field(default_factory=dict)  # node id -> its (first) row
    load: tuple[float, float, float] = field(default_factory=os.getloadavg)
    ran: int = 0
    failed: int = 0
    left_out: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, nodeid: str, promise: str, **counts) -> None:
        """Counts of one test (its parametrized cases together) towards one promise."""
        test = nodeid.split("::", 1)[-1].split("[", 1)[0]
        entry = self.entries.setdefault((promise, test), Entry(promise, test))
        for key, value in counts.items():
            setattr(entry, key, getattr(entry, key) + value)
        self.tests[nodeid] = entry


LEDGER = Ledger()


@pytest.fixture
def ledger(request):
    """``ledger(promise, trials=.., faults=.., inputs=.., lost=..)`` adds to this test's row."""
    return lambda promise, **counts: LEDGER.add(request.node.nodeid, promise, **counts)


def _ours(item) -> bool:
    return HERE in Path(str(item.fspath)).resolve().parents


def pytest_collection_finish(session):
    collected = {Path(str(item.fspath)).resolve() for item in session.items}
    LEDGER.left_out += sum(1 for path in HERE.glob("test_*.py") if path not in collected)


def pytest_deselected(items):
    LEDGER.left_out += sum(1 for item in items if _ours(item))


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith("tests/reliability/"):
        return
    if report.when == "call":
        LEDGER.ran += 1
        entry = LEDGER.tests.get(report.nodeid)
        if entry is not None:
            entry.seconds += report.duration
    if report.failed or report.skipped:
        LEDGER.failed += 1


def pytest_sessionfinish(session, exitstatus):
    if exitstatus != 0 or LEDGER.failed or LEDGER.left_out or not LEDGER.entries:
        return
    REPORT.write_text(render(LEDGER))


def render(ledger: Ledger) -> str:
    import torch

    rows = [f"| {e.promise} | `{e.test}` | {e.trials} | {e.faults} | {e.inputs} | {e.lost} | "
            f"{e.seconds:.0f} |" for e in sorted(ledger.entries.values(),
                                                   key=lambda e: e.promise)]
    total = list(ledger.entries.values())
    totals = (sum(e.trials for e in total), sum(e.faults for e in total),
              sum(e.inputs for e in total), sum(e.lost for e in total))
    return "\n".join([
        "# Reliability",
        "",
        "Written by `tests/reliability/` at the end of its last full, passing run; do not edit "
        "by hand.",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()}, "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{_cpus()} CPU cores (load average {ledger.load[0]:.1f} as it began: other work "
        f"shared them), {ledger.ran} tests in {time.monotonic() - ledger.started:.0f} s.",
        "",
        f"**Trials {totals[0]}, faults injected {totals[1]}, inputs tried {totals[2]}, "
        f"runs lost {totals[3]}.**",
        "",
        "A *trial* is one run put through a fault and carried to its end; a *fault* is one "
        "injected failure (a SIGKILL, a full disk, a non-finite loss, a broken sample, a "
        "corrupt file); an *input* is one generated config or command line; a run is *lost* "
        "when it neither finishes with the right result nor stops with one clear line.",
        "",
        "One row per promise and test (its parametrized cases added up).",
        "",
        "| promise | held by | trials | faults | inputs | runs lost | seconds |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

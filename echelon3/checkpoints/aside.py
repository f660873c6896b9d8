"""Checkpoints kept aside by ``resume_from``: newer than the one resumed, not yet passed.

``train resume_from=checkpoint-3.tar`` goes back to a chosen checkpoint of the run. The
rolling checkpoints after it, and ``best.tar`` when it was chosen later, would otherwise
be taken by the next automatic resume, or deleted by retention: they move into
``<target.path>/set-aside/`` instead (``history.jsonl`` is copied there too before the
resumed run rewinds it). Each is deleted once the resumed run writes a checkpoint at or
past it (it has been replaced); what the run never reaches stays there.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

FOLDER = "set-aside"
_NAME = re.compile(r"^checkpoint-(\d+)(?:-step(\d+))?\.(?:tar|dcp)$")


def position(path: Path) -> tuple[int, int] | None:
    """(completed epochs, step) a rolling checkpoint's name gives; an epoch's end sorts
    after every step inside that epoch, before the next one's."""
    m = _NAME.match(path.name)
    return None if m is None else (int(m.group(1)), int(m.group(2) or 0))


def set_aside(folder: Path, rolling: list[Path], chosen: Path, best_step: int | None,
              chosen_step: int) -> list[Path]:
    """Move the checkpoints after ``chosen`` (and ``best.tar`` with its hidden twin when
    ``best_step`` is past ``chosen_step``) into ``set-aside/``; the paths moved."""
    mark = position(chosen)
    later = [p for p in rolling if position(p) is not None and position(p) > mark]
    aside = folder / FOLDER
    moved = []
    if later or (best_step is not None and best_step > chosen_step):
        aside.mkdir(exist_ok=True)
        if (folder / "history.jsonl").is_file():
            shutil.copy2(folder / "history.jsonl", aside / "history.jsonl")
    for path in later:
        moved.append(Path(shutil.move(str(path), aside / path.name)))
    if best_step is not None and best_step > chosen_step:
        for name in ("best.tar", ".best.tar"):
            if (folder / name).exists():
                (aside / name).unlink(missing_ok=True)
                moved.append(Path(shutil.move(str(folder / name), aside / name)))
    if moved:
        log.info("resume_from=%s: %d later file(s) kept in %s until the run passes them",
                 chosen.name, len(moved), aside)
    return moved


def drop_passed(folder: Path, written: Path) -> None:
    """The run wrote ``written``: delete the set-aside checkpoints it has now replaced."""
    aside, mark = folder / FOLDER, position(written)
    if mark is None or not aside.is_dir():
        return
    for path in aside.iterdir():
        if position(path) is not None and position(path) <= mark:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)

"""The Benchmarks page and the measured figures of other pages: ``benchmarks/RESULTS.md``.

The benchmark scripts append to that file one dated section per run,
``## <benchmark> — <date>``, with the command and the machine. The docs show
the newest section of each benchmark and kind of table (one script may
measure several kinds of row, each named by its table's first column), copied,
never retyped.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path("benchmarks") / "RESULTS.md"
_SECTION = re.compile(r"^## (\S+) — (.+)$", re.M)


def _kind(body: str) -> str:
    """The first column's header of the section's first table: what its rows are."""
    header = next((line for line in body.splitlines() if line.startswith("|")), "|")
    return header.strip("|").split("|")[0].strip()


def latest_sections(repo: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """(benchmark name, kind of table) -> (date, body) of its newest section,
    in order of first appearance."""
    path = repo / RESULTS
    if not path.is_file():
        return {}
    text = path.read_text()
    marks = list(_SECTION.finditer(text))
    found: dict[tuple[str, str], tuple[str, str]] = {}
    for mark, following in zip(marks, [*marks[1:], None]):
        end = following.start() if following else len(text)
        body = text[mark.end():end].strip()
        found[(mark.group(1), _kind(body))] = (mark.group(2).strip(), body)
    return found


def _demote(text: str) -> str:
    return re.sub(r"^(#+) ", lambda m: "#" * min(6, len(m.group(1)) + 1) + " ", text, flags=re.M)


def render(repo: Path, names: tuple[str, ...] | None = None) -> str:
    """The newest section of each benchmark and kind (or of ``names``), one heading each."""
    sections = latest_sections(repo)
    measured = [name for name, _ in sections]
    wanted = [key for name in dict.fromkeys(names or measured)
              for key in sections if key[0] == name]
    missing = [n for n in (names or ()) if n not in measured]
    lines = []
    for key in wanted:
        name = key[0]
        date, body = sections[key]
        lines += [f"### `{name}`, {date}" if names else f"## `{name}`, {date}", "",
                  _demote(body), ""]
    if missing or not wanted:
        absent = ", ".join(f"`benchmarks/{n}.py`" for n in missing) or "the scripts in `benchmarks/`"
        lines += [f"Not measured yet: {absent} append here when run.", ""]
    return "\n".join(lines)

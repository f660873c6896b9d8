"""The Benchmarks page and the measured figures of other pages: ``benchmarks/RESULTS.md``.

The benchmark scripts append to that file one dated section per run,
``## <benchmark> — <date>``, with the command and the machine. The docs show
the newest section of each benchmark, copied, never retyped.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path("benchmarks") / "RESULTS.md"
_SECTION = re.compile(r"^## (\S+) — (.+)$", re.M)


def latest_sections(repo: Path) -> dict[str, tuple[str, str]]:
    """Benchmark name -> (date, body) of its newest section, in order of first appearance."""
    path = repo / RESULTS
    if not path.is_file():
        return {}
    text = path.read_text()
    marks = list(_SECTION.finditer(text))
    found: dict[str, tuple[str, str]] = {}
    for mark, following in zip(marks, [*marks[1:], None]):
        end = following.start() if following else len(text)
        found[mark.group(1)] = (mark.group(2).strip(), text[mark.end():end].strip())
    return found


def _demote(text: str) -> str:
    return re.sub(r"^(#+) ", lambda m: "#" * min(6, len(m.group(1)) + 1) + " ", text, flags=re.M)


def render(repo: Path, names: tuple[str, ...] | None = None) -> str:
    """The newest section of each benchmark (or of ``names``), one heading each."""
    sections = latest_sections(repo)
    wanted = [n for n in (names or tuple(sections)) if n in sections]
    missing = [n for n in (names or ()) if n not in sections]
    lines = []
    for name in wanted:
        date, body = sections[name]
        lines += [f"### `{name}`, {date}" if names else f"## `{name}`, {date}", "",
                  _demote(body), ""]
    if missing or not wanted:
        absent = ", ".join(f"`benchmarks/{n}.py`" for n in missing) or "the scripts in `benchmarks/`"
        lines += [f"Not measured yet: {absent} append here when run.", ""]
    return "\n".join(lines)

"""The Benchmarks page and the measured figures of other pages: ``benchmarks/RESULTS.md``.

The benchmark scripts write that file (dated, with the machine they ran on);
the docs copy its sections rather than retyping a number.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path("benchmarks") / "RESULTS.md"


def _results(repo: Path) -> str | None:
    path = repo / RESULTS
    return path.read_text() if path.is_file() else None


def _demote(text: str, levels: int) -> str:
    return re.sub(r"^(#+) ", lambda m: "#" * min(6, len(m.group(1)) + levels) + " ", text,
                  flags=re.M)


def render_all(repo: Path) -> str:
    """Everything ``RESULTS.md`` holds below its title."""
    text = _results(repo)
    if text is None:
        return (f"No results yet: `{RESULTS}` is written by the scripts in `benchmarks/` "
                "(see below).")
    body = re.sub(r"\A# .*\n", "", text.lstrip(), count=1)
    return _demote(body.strip(), 1 if re.search(r"^# ", body, re.M) else 0)


def section(repo: Path, heading: str) -> str:
    """One ``## heading`` section of ``RESULTS.md`` (its heading left out)."""
    text = _results(repo)
    if text is None:
        return f"No results yet (`{RESULTS}` has not been written)."
    match = re.search(rf"^##+ {re.escape(heading)}\s*\n(.*?)(?=^##? |\Z)", text, re.M | re.S)
    if match is None:
        raise KeyError(f"{RESULTS} has no section '{heading}'")
    return match.group(1).strip()

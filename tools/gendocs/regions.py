"""Find and replace the generated regions of a Markdown page."""

from __future__ import annotations

import re

START = "<!-- generated: {name} (python -m tools.gendocs) -->"
END = "<!-- end generated: {name} -->"


class RegionError(Exception):
    """A page lacks a region's markers, or has them out of order."""


def replace(text: str, name: str, body: str) -> str:
    """``text`` with the region ``name`` holding ``body``."""
    start, end = START.format(name=name), END.format(name=name)
    pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise RegionError(f"no '{start}' ... '{end}' markers")
    block = f"{start}\n{body.rstrip()}\n{end}"
    return pattern.sub(lambda _: block, text, count=1)


def names(text: str) -> list[str]:
    """Names of the regions a page holds, in order."""
    return re.findall(r"<!-- generated: ([\w-]+) \(python -m tools\.gendocs\) -->", text)

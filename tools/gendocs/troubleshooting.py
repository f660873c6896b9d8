"""The Troubleshooting page: every message of :mod:`tools.gendocs.error_sites`, with cause and fix.

Causes and fixes are written in ``errors.yaml`` beside this file, each entry
matching messages by a regular expression. Every message must be matched by
an entry and every entry must match a message, so a new raise site, or a
reworded one, fails the docs test until it is explained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from tools.gendocs.error_sites import Site, module_summaries, scan

EXPLANATIONS = Path(__file__).with_name("errors.yaml")
PREFIX = "echelon3: error: "  # said once at the top of the page, not in every heading
ANY_EXIT = "exit code 1, or 2 when every failed worker reported a user error"


class Unexplained(Exception):
    """Messages without an entry in errors.yaml, or entries that match nothing."""


@dataclass
class Entry:
    match: str
    cause: str
    fix: str
    used: bool = False


def load_entries(path: Path = EXPLANATIONS) -> tuple[list[Entry], list[dict]]:
    """(pattern entries, extra messages that no raise statement carries)."""
    data = yaml.safe_load(path.read_text())
    entries = [Entry(e["match"], e["cause"].strip(), e["fix"].strip()) for e in data["messages"]]
    return entries, data.get("extra", [])


def _explain(site_text: str, entries: list[Entry]) -> Entry | None:
    for entry in entries:
        if re.search(entry.match, site_text):
            entry.used = True
            return entry
    return None


def _extra_sites(repo: Path, extras: list[dict]) -> tuple[list[Site], list[str]]:
    """Messages built outside a raise (by a helper), and what no longer holds about them."""
    sites, problems = [], []
    for extra in extras:
        source, function = extra["where"].split(":")
        path = repo / source
        text = path.read_text() if path.is_file() else ""
        gone = [f"def {function}("] if f"def {function}(" not in text else []
        gone += [literal for literal in extra["literals"] if literal not in text]
        if gone:
            problems.append(f"extra '{extra['text']}': {source} no longer has {gone}")
        sites.append(Site(source, "message", extra["text"], extra.get("exit_code"), [function]))
    return sites, problems


def collect(repo: Path) -> list[tuple[Site, Entry]]:
    entries, extras = load_entries()
    extra_sites, problems = _extra_sites(repo, extras)
    explained = []
    for site in scan(repo) + extra_sites:
        entry = _explain(site.text, entries)
        if entry is None:
            problems.append(f"no entry for: {site.source} ({', '.join(site.places)}): "
                            f"{site.text}")
        else:
            explained.append((site, entry))
    problems += [f"matches nothing: {e.match}" for e in entries if not e.used]
    if problems:
        raise Unexplained("tools/gendocs/errors.yaml is out of step with the code:\n"
                          + "".join(f"  {p}\n" for p in problems))
    return explained


def _exit(code: int | None) -> str:
    return ANY_EXIT if code is None else f"exit code {code}"


# Sections in the order a run meets them; files not listed follow, in path order.
ORDER = ("echelon3/cli.py", "echelon3/config/compose.py", "echelon3/config/build.py",
         "echelon3/tasks/components.py", "echelon3/distributed/runtime.py",
         "echelon3/distributed/launch.py", "echelon3/data/loaders.py",
         "echelon3/distributed/precision.py", "echelon3/tasks/train.py")


def _rank(site: Site) -> tuple[int, str]:
    source = site.source
    return (ORDER.index(source) if source in ORDER else len(ORDER)
            + source.startswith("workflow/"), source)


def render(repo: Path) -> str:
    summaries = module_summaries(repo)
    lines = []
    current = None
    for site, entry in sorted(collect(repo), key=lambda pair: _rank(pair[0])):
        if site.source != current:
            current = site.source
            summary = summaries.get(site.source, "")
            lines += ["", f"## `{site.source}`", ""]
            if summary:
                lines += [summary.replace("``", "`").rstrip("."), ""]
        places = ", ".join(f"`{p}`" for p in site.places)
        lines += [f"### `{site.text.removeprefix(PREFIX)}`", "",
                  f"*{_exit(site.exit_code)}; from {places}*", "",
                  f"**Cause.** {entry.cause}", "", f"**Fix.** {entry.fix}", ""]
    count = sum(1 for line in lines if line.startswith("### "))
    return f"{count} messages.\n" + "\n".join(lines)

"""The CLI reference: every command, argument and default, read from the argparse parser."""

from __future__ import annotations

import argparse
import os


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.nargs != 0:
            names += f" `{action.metavar or action.dest.upper()}`"
        return names
    return f"`{action.metavar or action.dest}`" + (" ..." if action.nargs in ("*", "+") else "")


def _default(action: argparse.Action) -> str:
    if action.required and action.nargs not in ("*", "?"):
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [], ()):
        return ""
    return f"`{action.default}`"


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        rows.append(f"| {_flags(action)} | {_default(action)} | "
                    f"{(action.help or '').replace('|', '/')} |")
    return rows


def _commands(parser: argparse.ArgumentParser, prefix: str):
    """(full name, parser) of every leaf command below ``parser``, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from _commands(sub, f"{prefix} {name}")
                else:
                    yield f"{prefix} {name}", sub


def render() -> str:
    from echelon3.cli import parser

    os.environ["COLUMNS"] = "80"  # argparse wraps usage lines at the terminal's width
    top = parser()
    lines = ["```text", top.format_usage().strip(), "```", ""]
    for name, sub in _commands(top, "echelon3"):
        lines += [f"## `{name}`", "", sub.description or "", "",
                  "```text", sub.format_usage().strip(), "```", "", *_arguments(sub), ""]
        if sub.epilog:
            lines += ["```text", sub.epilog.strip(), "```", ""]
    lines += ["## Options of `echelon3`", "", *_arguments(top), ""]
    return "\n".join(lines)

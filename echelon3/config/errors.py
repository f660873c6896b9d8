"""Errors a user can cause. The CLI turns them into one line and exit code 2."""

from __future__ import annotations

import difflib
from typing import Iterable


class UserError(Exception):
    """A problem in the config, the command line or the files a run points at.

    ``key`` is the config path at fault (``optimizer.type``) or a file name;
    the message always starts with it so the user knows where to look.
    """

    def __init__(self, key: str | None, message: str):
        self.key = key
        self.message = message
        super().__init__(one_line(f"{key}: {message}" if key else message))


def one_line(text: str) -> str:
    """``text`` with control characters (a newline in a key, a stray CR) shown as escapes."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in str(text))


class ConfigError(UserError):
    """The YAML, its composition, or an override is wrong."""


class BuildError(UserError):
    """A component could not be imported or constructed."""


class BatchSizeError(UserError, ValueError):
    """A global batch size that the world size does not divide."""


class CheckpointError(UserError):
    """A checkpoint file that cannot be used."""


class WriteError(UserError):
    """A file of the run could not be written: disk full, quota, read-only, permissions."""


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (torch.save wraps a failed write in a RuntimeError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def write_error(path, e: BaseException) -> WriteError | None:
    """A :class:`WriteError` naming ``path`` and the system's reason, if ``e`` is an OSError."""
    cause = os_error_in(e)
    if cause is None:
        return None
    return WriteError(str(path), f"cannot write ({cause.strerror or cause})")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return `` (did you mean 'x'?)`` for the closest choice, or ``''``.

    Case is ignored when comparing, so ``Adamw`` suggests ``AdamW``, not ``Adam``.
    """
    by_lower: dict[str, str] = {}
    for choice in choices:
        by_lower.setdefault(str(choice).lower(), str(choice))
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean '{by_lower[close[0]]}'?)" if close else ""

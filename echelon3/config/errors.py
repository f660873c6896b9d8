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


# --------------------------------------------------------------------------- blame
# An exception from a component's own code (a metric's update, the network's forward)
# is not the user's mistake in the config's words, but the config key that built the
# component tells the user where to look. Call sites mark what they were running; the
# innermost mark of each kind wins.
_KEY, _DURING = "_echelon3_key", "_echelon3_during"


def blame(error: BaseException, key: str | None = None, during: str | None = None) -> None:
    """Mark ``error`` as raised by the component at config ``key``, while ``during``."""
    for name, value in ((_KEY, key), (_DURING, during)):
        if value is not None and getattr(error, name, None) is None:
            try:
                setattr(error, name, value)
            except AttributeError:  # an exception type without a __dict__
                return


def blamed(error: BaseException) -> str | None:
    """``metrics.auroc: IndexError: index 140 is out of bounds (during validation)``: the
    one line naming the component ``error`` came from, or None when no call site knew."""
    key = getattr(error, _KEY, None)
    if key is None:
        return None
    during = getattr(error, _DURING, None)
    text = one_line(str(error).strip().splitlines()[0]) if str(error).strip() else ""
    what = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return f"{key}: {what}" + (f" (during {during})" if during else "")

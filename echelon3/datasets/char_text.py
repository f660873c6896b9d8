"""Characters of English text as token files: one token per character, nanoGPT's
``shakespeare_char`` way, from text that ships with Python itself.

The default text is the stdlib's ``pydoc_data.topics`` (the pages ``help('if')``
shows; about 465,000 characters in Python 3.11), its topics joined in the order of
their names, so it is the same text on every machine with the same Python. The
vocabulary is the sorted set of the text's characters; ids are positions in it::

    python -m echelon3.datasets.char_text data/char_text [--val-fraction 0.1] [--text FILE]

writes ``train.bin`` (the first characters) and ``val.bin`` (the last
``int(len(text) * val_fraction)``) as uint16 token files
(:func:`echelon3.datasets.token_windows.write_tokens`, read by ``TokenWindows``) and
``vocab.json`` (``{"chars": [...]}``, read back by :meth:`Vocab.load`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from echelon3.datasets.token_windows import write_tokens

UNKNOWN = "\ufffd"  # what decode writes for an id the vocabulary has no character for


def pydoc_text() -> str:
    """The stdlib's pydoc topics, joined by newlines in the order of their names."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in sorted(topics))


class Vocab:
    """Characters and their ids (positions in ``chars``)."""

    def __init__(self, chars):
        self.chars = list(chars)
        if len(set(self.chars)) != len(self.chars) or any(len(c) != 1 for c in self.chars):
            raise ValueError("a vocabulary is a list of distinct single characters")
        self.ids = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def of(cls, text: str) -> "Vocab":
        return cls(sorted(set(text)))

    @classmethod
    def load(cls, path) -> "Vocab":
        return cls(json.loads(Path(path).read_text(encoding="utf-8"))["chars"])

    def save(self, path) -> Path:
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"chars": self.chars}, ensure_ascii=False),
                           encoding="utf-8")
        os.replace(partial, path)
        return path

    def __len__(self) -> int:
        return len(self.chars)

    def missing(self, text: str) -> list[str]:
        """The characters of ``text`` the vocabulary lacks, in order of appearance."""
        return list(dict.fromkeys(c for c in text if c not in self.ids))

    def encode(self, text: str) -> np.ndarray:
        lacking = self.missing(text)
        if lacking:
            raise ValueError(f"characters not in the vocabulary: {''.join(lacking)!r}")
        return np.fromiter((self.ids[c] for c in text), dtype=np.int64, count=len(text))

    def decode(self, ids) -> str:
        chars, size = self.chars, len(self.chars)
        return "".join(chars[i] if 0 <= i < size else UNKNOWN for i in map(int, ids))


def prepare(out_dir, text: str | None = None, val_fraction: float = 0.1) -> dict[str, int]:
    """Write ``train.bin``, ``val.bin`` and ``vocab.json`` of ``text`` (default: the pydoc
    topics) into ``out_dir``; the counts of characters written."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
    text = pydoc_text() if text is None else text
    vocab = Vocab.of(text)
    tokens = vocab.encode(text)
    val = int(len(tokens) * val_fraction)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokens(out / "train.bin", tokens[:len(tokens) - val])
    write_tokens(out / "val.bin", tokens[len(tokens) - val:])
    vocab.save(out / "vocab.json")
    return {"characters": len(tokens), "train": len(tokens) - val, "val": val,
            "vocab": len(vocab)}


def _fraction(value: str) -> float:
    number = float(value)
    if not 0 < number < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, got {value}")
    return number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echelon3.datasets.char_text",
                                     description="Character token files of a text.")
    parser.add_argument("out_dir", help="folder for train.bin, val.bin and vocab.json")
    parser.add_argument("--val-fraction", type=_fraction, default=0.1,
                        help="the share of the text, from its end, that validates (0.1)")
    parser.add_argument("--text", type=Path, default=None,
                        help="a UTF-8 text file (default: the stdlib's pydoc topics)")
    args = parser.parse_args(argv)
    if args.text is not None and not args.text.is_file():
        parser.error(f"--text: no file {args.text}")
    text = None if args.text is None else args.text.read_text(encoding="utf-8")
    counts = prepare(args.out_dir, text, args.val_fraction)
    print(f"{args.out_dir}: {counts['characters']} characters ({counts['train']} train, "
          f"{counts['val']} val), {counts['vocab']} in the vocabulary")
    return 0


if __name__ == "__main__":
    sys.exit(main())

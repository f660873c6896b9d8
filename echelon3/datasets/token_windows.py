"""Random windows of a token file, nanoGPT's way: a stream of ``(x, y)`` next-token pairs.

The file is a flat array of uint16 token ids (:func:`write_tokens` writes one),
memory-mapped lazily in each process that reads it. Sample ``k`` of a shard is the
window at an offset ``i`` drawn from the stream's generator, seeded from
(seed, epoch, shard, k) (:func:`echelon3.data.streams.stream_seed`)::

    i = torch.randint(len(tokens) - block_size, (1,), generator=generator)
    x, y = tokens[i : i + block_size], tokens[i + 1 : i + block_size + 1]   # int64

so a resumed stream needs no state beyond the count of windows drawn. ``samples``: the
windows of one pass over all shards (a finite pass, e.g. for validation); None draws
without end. ``seed``: None takes root ``seed``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from echelon3.data.streams import Stream

TOKEN_DTYPE = np.uint16


def write_tokens(path, array) -> Path:
    """Write ``array`` (whole numbers in 0..65535) as a uint16 token file, atomically."""
    values = np.asarray(array)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a 1-D array of integers, got {values.dtype} "
                         f"of shape {values.shape}")
    if values.size and (values.min() < 0 or values.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError("token ids must lie in 0..65535 to be stored as uint16")
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    values.astype(TOKEN_DTYPE).tofile(partial)
    os.replace(partial, path)
    return path


class TokenWindows(Stream):
    """Windows of ``block_size + 1`` tokens of the uint16 file at ``path``, as (x, y)."""

    def __init__(self, path: str, block_size: int, seed: int | None = None,
                 samples: int | None = None):
        super().__init__(seed)
        for name, value in (("block_size", block_size), ("samples", samples)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
        self.path, self.block_size, self.samples = Path(path), block_size, samples
        if not self.path.is_file():
            raise ValueError(f"path: no token file at '{path}'")
        self.length = self.path.stat().st_size // np.dtype(TOKEN_DTYPE).itemsize
        if self.length < block_size + 1:
            raise ValueError(f"path: '{path}' holds {self.length} tokens, too few for one "
                             f"window of block_size {block_size} + 1")
        self._tokens: np.memmap | None = None
        self._opened_by: int | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_tokens"] = state["_opened_by"] = None  # each process maps the file itself
        return state

    def tokens(self) -> np.memmap:
        """The token file, mapped once per process (a forked worker maps its own)."""
        if self._tokens is None or self._opened_by != os.getpid():
            self._tokens = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
            self._opened_by = os.getpid()
        return self._tokens

    def __iter__(self):
        tokens, block = self.tokens(), self.block_size
        offsets = len(tokens) - block
        for _ in self.shard(None if self.samples is None else range(self.samples)):
            i = int(torch.randint(offsets, (1,), generator=self.generator))
            window = torch.from_numpy(tokens[i:i + block + 1].astype(np.int64))
            yield window[:-1], window[1:]

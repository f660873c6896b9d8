"""Checkpoint writes that do not stop training (``target.async_save: true``).

A save in the background has two halves. On the training thread, before the save
returns, :meth:`BackgroundWriter.copy` takes a deep copy of the state: every tensor
is copied to the CPU (into pinned memory when it lives on a GPU, so the copy is a
fast DMA), and the copy's buffers are kept and reused by the next save whose
tensors have the same shapes, so a run does not allocate a model's worth of host
memory per epoch. Then :meth:`BackgroundWriter.submit` hands the write to one
thread. At most one write is in flight: a new one first waits for the previous
one, which is also what makes reusing the buffers safe.

A failure in the background is kept and raised by the next :meth:`wait` (or the
next save), as the same error the synchronous write would have raised.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


class BackgroundWriter:
    """One background write at a time, and the host buffers its copies reuse."""

    def __init__(self, name: str = "echelon3-checkpoint"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._from_gpu = False

    # ------------------------------------------------------------------ the copy

    def copy(self, obj: Any) -> Any:
        """A deep copy of ``obj`` whose tensors are on the CPU and share nothing with it.

        Waits for the write in flight first: its buffers are the ones reused here.
        """
        self.wait()
        self._from_gpu = False
        copied = self._copy(obj, (), {})
        if self._from_gpu:
            torch.cuda.synchronize()  # the non-blocking copies out of the GPU have landed
        return copied

    def _copy(self, obj: Any, where: tuple, memo: dict[int, torch.Tensor]) -> Any:
        if torch.is_tensor(obj):
            return self._tensor(obj, where, memo)
        if type(obj) in (dict, OrderedDict):
            copied = type(obj)((k, self._copy(v, (*where, k), memo)) for k, v in obj.items())
            if type(obj) is OrderedDict:  # a state_dict's _metadata goes along
                copied.__dict__.update(copy.deepcopy(obj.__dict__))
            return copied
        if type(obj) in (list, tuple):
            return type(obj)(self._copy(v, (*where, i), memo) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, where: tuple, memo: dict[int, torch.Tensor]):
        if id(t) in memo:  # the same tensor twice in the state stays one tensor
            return memo[id(t)]
        pinned = t.is_cuda
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype \
                or buffer.is_pinned() != pinned:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            self._buffers[where] = buffer
        buffer.copy_(t.detach(), non_blocking=pinned)
        self._from_gpu |= pinned
        memo[id(t)] = buffer
        return buffer

    # ------------------------------------------------------------------ the write

    def submit(self, write: Callable[[], None]) -> None:
        """Run ``write()`` on the background thread, once the write in flight is done."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name=self.name)
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # kept for wait(), raised on the training thread
            self._error = e

    def wait(self) -> None:
        """Wait for the write in flight; raise what it raised (once)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

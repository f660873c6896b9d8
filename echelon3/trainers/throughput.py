"""Samples, tokens, time per optimizer step and MFU of every train record.

Each train record covers the optimizer steps since the one before it (in its epoch:
the first record of an epoch covers the steps since the epoch began). The host counts
every micro-batch's samples (the length of its target) and tokens (the elements of
integer inputs of shape (B, T), ``trainer.config.count_tokens``), and under DDP the log
point's one collective sums them over the ranks, so the figures are exact. The time is
the wall clock read at log points, right after the previous log point's numbers were
read, which waits for the device: no sync is added. Validation and checkpoints in the
middle of an epoch are taken out of the time; the loader's waits stay in.

A record carries ``samples_per_s``, ``tokens_per_s`` (when there are tokens),
``step_ms`` (wall time per optimizer step, not per micro-batch) and, with
``trainer.config.flops_per_step``, ``flops_per_s`` (all ranks) and ``mfu``: ``flops_per_s``
/ (world size x one device's peak). The run's figures in ``summary.json`` leave out
its first record (compiling and warming up) when there are others.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Mapping

import torch

from echelon3.config.errors import ConfigError
from echelon3.data.batches import batch_size, split_batch

log = logging.getLogger(__name__)

# The train record's keys that come from the wall clock (never equal between two runs).
CLOCK_KEYS = ("samples_per_s", "tokens_per_s", "step_ms", "flops_per_s", "mfu")
FLOPS_KEY, PEAK_KEY, TOKENS_KEY = ("trainer.config.flops_per_step",
                                   "trainer.config.peak_flops", "trainer.config.count_tokens")


def _positive(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


def batch_tokens(inputs: Any, mode: Any) -> int | None:
    """Tokens of a micro-batch's ``inputs``: ``auto``: the elements of an integer tensor of
    shape (B, T) (or of a mapping's ``input_ids``); ``true``: B x T of any tensor whose first
    two dimensions they are; ``false``: None."""
    if isinstance(inputs, Mapping):
        inputs = inputs.get("input_ids") if mode == "auto" else next(iter(inputs.values()))
    if mode is False or not isinstance(inputs, torch.Tensor):
        return None
    if mode == "auto":
        integer = not inputs.is_floating_point() and not inputs.is_complex() and \
            inputs.dtype != torch.bool
        return inputs.numel() if inputs.dim() == 2 and integer else None
    return int(inputs.shape[0] * inputs.shape[1]) if inputs.dim() >= 2 else None


class Throughput:
    """One per trainer. ``flops_per_step``: None (no MFU), ``count`` or the FLOPs of one
    optimizer step over all ranks; ``peak_flops``: one device's peak, None: the table's."""

    def __init__(self, count_tokens: Any = "auto", flops_per_step: Any = None,
                 peak_flops: Any = None):
        if count_tokens not in ("auto", True, False):
            raise ConfigError("trainer.config.count_tokens",
                              f"must be auto, true or false, got {count_tokens!r}")
        if flops_per_step not in (None, "count") and not _positive(flops_per_step):
            raise ConfigError("trainer.config.flops_per_step",
                              "must be null, count, or the FLOPs of one optimizer step over "
                              f"all ranks (a positive number), got {flops_per_step!r}")
        if peak_flops is not None and not _positive(peak_flops):
            raise ConfigError("trainer.config.peak_flops",
                              "must be null (the peak table's) or one device's peak FLOP/s "
                              f"(a positive number), got {peak_flops!r}")
        self.tokens_mode = count_tokens
        self.counting = flops_per_step == "count"  # on the first micro-batch
        self.flops_per_step = None if flops_per_step in (None, "count") else float(flops_per_step)
        self.peak, self.peak_what, self.world = peak_flops, PEAK_KEY, 1
        self.samples, self.tokens, self.has_tokens = 0, 0, False
        self._since, self._step, self._aside = None, 0, 0.0
        self._marks: dict[int, dict] = {}
        self._last: dict | None = None
        self._runs: list[tuple[float, float, float, int]] = []  # (s, samples, tokens, steps)

    def resolve_peak(self, device, precision_mode: str, world: int, net=None) -> None:
        """The peak of one device (the table's, unless given) and the world size."""
        from echelon3.distributed.fsdp import sharded_module
        from echelon3.observe.peaks import device_peak

        if self.counting and net is not None and sharded_module(net) is not None:
            raise ConfigError("trainer.config.flops_per_step",
                              "count is not available under strategy: fsdp; give the FLOPs "
                              "of one optimizer step over all ranks as a number")
        self.world = world
        if self.peak is not None or (self.flops_per_step is None and not self.counting):
            return
        self.peak, self.peak_what = device_peak(device, precision_mode)
        if self.peak is None:
            log.info("MFU n/a (%s); set %s to one device's peak FLOP/s", self.peak_what,
                     PEAK_KEY)

    def counted(self, flops: int, micro_batches: int) -> None:
        """One micro-batch's forward and backward on one rank took ``flops``: a step takes
        that x ``micro_batches`` x the world size."""
        self.counting = False
        self.flops_per_step = float(flops) * micro_batches * self.world
        log.info("%.4g FLOPs per optimizer step (%.4g per micro-batch's forward and backward "
                 "x %d micro-batches x %d ranks; %s)", self.flops_per_step, flops,
                 micro_batches, self.world, FLOPS_KEY)

    # ------------------------------------------------------------------ on the host

    def start(self, now: float, step: int, aside: float) -> None:
        """An epoch begins: the next record's time starts here."""
        self._since, self._step, self._aside = now, step, aside

    def add(self, batch: Any) -> None:
        """One micro-batch's samples and tokens (shapes only: nothing waits)."""
        inputs, target = split_batch(batch)
        if type(target) is torch.Tensor and type(inputs) is torch.Tensor and \
                inputs.is_floating_point() and self.tokens_mode == "auto":
            self.samples += target.shape[0]  # the common case, float inputs: no token probe
            return
        self.samples += batch_size(target)
        tokens = batch_tokens(inputs, self.tokens_mode)
        if tokens is not None:
            self.tokens, self.has_tokens = self.tokens + tokens, True

    def take(self) -> list[float]:
        """This rank's [samples, tokens] since the last record (summed over ranks later)."""
        seen, self.samples, self.tokens = [float(self.samples), float(self.tokens)], 0, 0
        return seen

    def mark(self, record: dict, now: float, synced: bool, step: int, aside: float,
             seen: list[float]) -> None:
        """``record``'s interval ends ``now`` (``synced``: the device had finished it)."""
        if self._since is None:
            self.start(now, step, aside)
        mark = {"s": now - self._since - (aside - self._aside), "steps": step - self._step,
                "seen": seen, "synced": synced, "now": now, "aside": aside}
        self._marks[id(record)] = self._last = mark
        self._since, self._step, self._aside = now, step, aside

    def settle(self, now: float, aside: float) -> None:
        """The epoch's end, read now: a last interval that ended unsynced ends here."""
        mark = self._last
        if mark is not None and not mark["synced"]:
            mark["s"] += now - mark["now"] - (aside - mark["aside"])
            mark["synced"], self._since, self._aside = True, now, aside

    # ------------------------------------------------------------------ when read

    def fill(self, record: dict, summed: list[float] | None) -> dict:
        """``record`` with its figures; ``summed``: [samples, tokens] over all ranks (None in
        one process: this rank's own)."""
        mark = self._marks.pop(id(record), None)
        if mark is None or mark["s"] <= 0 or mark["steps"] <= 0:
            return record
        samples, tokens = summed if summed is not None else mark["seen"]
        seconds = mark["s"]
        record["samples_per_s"] = samples / seconds
        if self.has_tokens:
            record["tokens_per_s"] = tokens / seconds
        record["step_ms"] = 1e3 * seconds / mark["steps"]
        if self.flops_per_step is not None:
            record["flops_per_s"] = self.flops_per_step * mark["steps"] / seconds
            if self.peak:
                record["mfu"] = record["flops_per_s"] / (self.world * self.peak)
        self._runs.append((seconds, samples, tokens, mark["steps"]))
        return record

    def summary(self) -> dict | None:
        """The attempt's figures over its records, its first left out when others follow."""
        runs = self._runs[1:] if len(self._runs) > 1 else self._runs
        if not runs:
            return None
        seconds, samples, tokens, steps = (sum(column) for column in zip(*runs))
        out = {"samples_per_s": samples / seconds, "step_ms": 1e3 * seconds / steps,
               "steps_timed": steps, "first_record_left_out": len(self._runs) > 1}
        if self.has_tokens:
            out["tokens_per_s"] = tokens / seconds
        if self.flops_per_step is not None:
            out["flops_per_step"] = self.flops_per_step
            out["flops_per_s"] = self.flops_per_step * steps / seconds
            out["peak_flops"] = self.peak
            out["mfu"] = out["flops_per_s"] / (self.world * self.peak) if self.peak else \
                f"n/a ({self.peak_what}; set {PEAK_KEY})"
        return out

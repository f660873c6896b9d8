"""The end of ``echelon3 train``: one block saying what the run gave, and ``summary.json``.

``summary.json`` is the last file a run writes (atomically, rank 0), so it
exists only for a finished run: the workflow's train rule declares it as an
output, and a partly trained ``best.tar`` is never taken for a finished one.
A run that stops before its first checkpoint takes back the files it wrote.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch

from echelon3.checkpoints.files import BEST, KEPT_BEST, atomic_write_text
from echelon3.data.splits import TEST, describe
from echelon3.distributed.ranks import is_main
from echelon3.trainers.validating import validation_epoch

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
# What a run writes before its first checkpoint (see forget_unfinished).
EARLY_FILES = ("config.yaml", "history.jsonl", "tensorboard", "mlflow.json", "wandb.json",
               SUMMARY)


def _natural(name: str) -> list:
    """checkpoint-9.tar before checkpoint-10.tar."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def best_checkpoint(folder: Path) -> dict | None:
    """Of ``best.tar``: the epoch its validation belongs to (as its history record says),
    step, metrics, and the data that chose it (``val`` or ``test``; checkpoints that do not
    say were chosen on the test set); tensors memory-mapped."""
    path = folder / KEPT_BEST if (folder / KEPT_BEST).exists() else folder / BEST
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {"epoch": validation_epoch(state), "step": int(state["global_step"]),
            "metrics": {k: float(v) for k, v in (state.get("metrics") or {}).items()},
            "selected_on": str(state.get("selected_on") or TEST)}


def trained_line(epochs: int, before: int, elapsed: float) -> str:
    """What this attempt trained: ``trained 10 epochs in 2.8 s``, ``trained epochs 11-20
    (resumed after epoch 10) in ...``, or that nothing was left to train."""
    if epochs <= before:
        return (f"nothing trained: {before} epochs were already done (raise "
                f"trainer.config.epochs to train more)")
    if before == 0:
        return f"trained {epochs} epoch{'s' if epochs != 1 else ''} in {elapsed:.1f} s"
    which = f"epoch {epochs}" if epochs == before + 1 else f"epochs {before + 1}-{epochs}"
    return f"trained {which} (resumed after epoch {before}) in {elapsed:.1f} s"


def steps_line(steps: int, before: int, max_steps: int, elapsed: float) -> str:
    """What an attempt of a run counted in steps trained."""
    if steps <= before:
        return (f"nothing trained: {before} of {max_steps} steps were already done (raise "
                f"trainer.config.max_steps to train more)")
    resumed = f" (resumed at step {before})" if before else ""
    return f"trained steps {before + 1}-{steps} of {max_steps}{resumed} in {elapsed:.1f} s"


def flop_rate(flops_per_s: float) -> str:
    """``312 TFLOP/s``, ``1.3 MFLOP/s``."""
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops_per_s >= size:
            return f"{flops_per_s / size:.3g} {prefix}FLOP/s"
    return f"{flops_per_s:.3g} FLOP/s"


def speed_line(throughput: dict) -> str:
    """``1.23e+04 samples/s, 4.5 ms/step, MFU 41.2%`` from the summary's ``throughput``."""
    parts = [f"{throughput['samples_per_s']:.4g} samples/s"]
    if "tokens_per_s" in throughput:
        parts.append(f"{throughput['tokens_per_s']:.4g} tokens/s")
    parts.append(f"{throughput['step_ms']:.4g} ms/step")
    if "flops_per_s" in throughput:
        parts.append(flop_rate(throughput["flops_per_s"]))
    mfu = throughput.get("mfu")
    if mfu is not None:
        parts.append(f"MFU {mfu:.1%}" if isinstance(mfu, float) else f"MFU {mfu}")
    warm = " (after the first record)" if throughput.get("first_record_left_out") else ""
    return ", ".join(parts) + warm


def finish(folder: Path, epochs: int, started: float, before: tuple[int, int] | int = 0,
           stopped: str | None = None, steps: int | None = None,
           max_steps: int | None = None, resumed_from: Path | None = None,
           throughput: dict | None = None) -> dict | None:
    """Write ``summary.json`` and log the closing block (rank 0); the summary.
    ``epochs``, ``steps``: done in all; ``before``: (epochs, steps) done before this
    attempt; ``stopped``: why early stopping ended the run, if it did; ``max_steps``: the
    run is counted in steps; ``resumed_from``: the checkpoint this attempt went on from;
    ``throughput``: this attempt's samples/s, step time and MFU
    (:meth:`echelon3.trainers.throughput.Throughput.summary`)."""
    if not is_main():
        return None
    before, before_steps = before if isinstance(before, tuple) else (before, 0)
    best = best_checkpoint(folder)
    files = {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
             if not p.name.startswith(".")} | {SUMMARY}
    summary = {"epochs": epochs, "epochs_trained": max(epochs - before, 0), "best": best,
               "elapsed_s": round(time.time() - started, 1),
               "files": sorted(files, key=_natural),
               "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               **({"steps": steps, "steps_trained": max(steps - before_steps, 0)}
                  if steps is not None else {}),
               **({"max_steps": max_steps} if max_steps is not None else {}),
               **({"resumed_from": Path(resumed_from).name} if resumed_from else {}),
               **({"throughput": throughput} if throughput else {}),
               **({"stopped_early": stopped} if stopped else {})}
    atomic_write_text(folder / SUMMARY, json.dumps(summary, indent=2) + "\n")
    if best is None:
        best_line = "no validation result"
    else:
        scores = " | ".join(f"{k} {v:.4f}" for k, v in best["metrics"].items())
        best_line = (f"epoch {best['epoch']} (step {best['step']}, "
                     f"{describe(best['selected_on'])}): {scores}")
    if stopped and (steps or 0) <= before_steps and epochs <= before:
        trained = "nothing trained: the run had stopped early"
    elif max_steps is not None and steps is not None:
        trained = steps_line(steps, before_steps, max_steps, summary["elapsed_s"])
    else:
        trained = trained_line(epochs, before, summary["elapsed_s"])
    if resumed_from:
        trained += f"\n  from     {Path(resumed_from).name}"
    speed = f"\n  speed    {speed_line(throughput)}" if throughput else ""
    log.info("%s%s\n  best     %s\n  written  %s%s: %s%s", trained,
             f"\n  {stopped}" if stopped else "", best_line, folder, os.sep,
             ", ".join(summary["files"]), speed)
    return summary


def forget_unfinished(folder: Path, started: float) -> None:
    """After a failure: if no checkpoint was ever written, remove what this run wrote
    since ``started`` (and the folder, once empty), so no half-made run is left behind."""
    if not is_main() or not folder.is_dir():
        return
    if (folder / KEPT_BEST).exists() or (folder / BEST).exists() or \
            any(folder.glob("checkpoint-*.tar")) or any(folder.glob("checkpoint-*.dcp")):
        return
    for name in EARLY_FILES:
        path = folder / name
        if not path.exists() or path.stat().st_mtime < started - 1:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # something else lives there (an earlier run moved aside): keep it

"""Collectives per step under DDP, counted on 2 gloo ranks: the loop runs none between log
points (``nan_policy: stop``), one at each log point, and one flag per optimizer step
under ``nan_policy: skip``. DDP's own gradient all-reduce runs in its C++ reducer and is
not counted here (tests/test_accumulation.py counts it per window). Python's garbage is
collected at the same steps on both ranks (``gc_every_n_steps``), and never in between."""

from __future__ import annotations

import collections
import gc
import itertools
import json
import socket
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

STEPS, LOG_EVERY, GC_EVERY = 8, 4, 3
COLLECTIVES = ("all_reduce", "all_gather_object", "all_gather", "broadcast", "barrier",
               "broadcast_object_list", "gather", "reduce", "all_to_all")


def _worker(rank: int, port: int, out: str) -> None:
    import os

    from torch.nn.parallel import DistributedDataParallel

    from tests.helpers import blobs, loader, make_trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    counts: collections.Counter = collections.Counter()
    trainer = None
    for name in COLLECTIVES:
        original = getattr(tdist, name)

        def counted(*args, _original=original, **kwargs):
            if trainer is not None:
                counts[trainer.global_step] += 1
            return _original(*args, **kwargs)

        setattr(tdist, name, counted)
    collected: list[int] = []
    gc.callbacks.append(lambda phase, info: phase == "start" and trainer is not None
                        and not gc.isenabled() and collected.append(trainer.global_step))
    for policy in ("stop", "skip"):
        torch.manual_seed(0)
        net = DistributedDataParallel(torch.nn.Linear(4, 3))
        inputs, labels = blobs(STEPS * 16)
        trainer = make_trainer(Path(out) / f"{policy}{rank}", net=net, epochs=1,
                               nan_policy=policy, log_every_n_steps=LOG_EVERY,
                               gc_every_n_steps=GC_EVERY,
                               train_loader=loader(inputs[rank::2], labels[rank::2], 8))
        counts.clear()
        collected.clear()
        trainer.fit()
        assert gc.isenabled() and gc.get_freeze_count() == 0  # as fit found it
        Path(out, f"{policy}{rank}.json").write_text(json.dumps(dict(counts)))
        Path(out, f"{policy}{rank}.gc.json").write_text(json.dumps(collected))
        trainer = None
    tdist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collectives_per_step(tmp_path):
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fork from pytest's process can hang gloo
    for policy, rank in itertools.product(("stop", "skip"), range(2)):
        counts = {int(k): v for k, v in
                  json.loads((tmp_path / f"{policy}{rank}.json").read_text()).items()}
        # Collectives issued while global_step == s: the log point after step s, and under
        # skip the flag deciding step s + 1. Step STEPS ends the epoch (validation, save).
        per_step = [counts.get(s, 0) for s in range(STEPS)]
        skip = int(policy == "skip")
        assert per_step == [skip + (s > 0 and s % LOG_EVERY == 0) for s in range(STEPS)]
        # Once before the first step (the set-up's young garbage), then after every
        # GC_EVERY-th step: no automatic collection anywhere else, validation included.
        collected = json.loads((tmp_path / f"{policy}{rank}.gc.json").read_text())
        assert collected == [0, *range(GC_EVERY, STEPS + 1, GC_EVERY)]

"""The GPT training loop a researcher writes by hand, in the manner of nanoGPT's train.py.

    python benchmarks/gpt_handwritten.py SETTINGS.json OUT_DIR
    torchrun --nproc_per_node 2 benchmarks/gpt_handwritten.py SETTINGS.json OUT_DIR

``SETTINGS.json`` (written by ``gpt_loop.py`` from config/experiments/char_gpt.yaml and
its overrides) gives the network, the token files and the recipe. Each optimizer step:
``accum`` micro-batches of random windows of the token file, the loss divided by
``accum``, DDP's all-reduce only on the last one (``no_sync`` before it), clipping, AdamW
with weight decay on the 2-D tensors only, the learning rate set by hand (linear warmup,
then cosine) before the step. One thread per rank.

The windows are drawn as ``TokenWindows`` draws them (offset ``i`` from a generator
seeded per sample from (seed, epoch 0, rank, k)), and the network is built and seeded in
echelon3's order, so in fp32 both loops train the same network on the same data.
``OUT_DIR/final.json``: the validation loss at the end and the wall clock at every
``log_every`` steps.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echelon3.data.rng import sample_seed  # noqa: E402  (the windows' seeds, as TokenWindows)
from echelon3.nets.gpt import GPT  # noqa: E402


def seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


class Windows:
    """Random windows of one rank's share of a uint16 token file, sample by sample."""

    def __init__(self, path: str, block: int, seed_: int, rank: int):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block, self.base, self.drawn = block, sample_seed(seed_, 0, rank), 0
        self.generator = torch.Generator()

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(size):
            self.generator.manual_seed(sample_seed(self.base, 0, self.drawn))
            i = int(torch.randint(len(self.data) - self.block, (1,), generator=self.generator))
            rows.append(torch.from_numpy(self.data[i:i + self.block + 1].astype(np.int64)))
            self.drawn += 1
        xy = torch.stack(rows)
        return xy[:, :-1], xy[:, 1:]


def lr_at(step: int, s: dict) -> float:
    """Linear warmup from ``start_factor`` x lr over ``warmup`` steps, then cosine to
    ``min_lr`` at the last step (what SequentialLR(LinearLR, CosineAnnealingLR) gives)."""
    if step < s["warmup"]:
        return s["lr"] * (s["start_factor"] + (1 - s["start_factor"]) * step / s["warmup"])
    progress = (step - s["warmup"]) / (s["steps"] - s["warmup"])
    return s["min_lr"] + (s["lr"] - s["min_lr"]) * (1 + math.cos(math.pi * progress)) / 2


@torch.no_grad()
def val_loss(net, s: dict, rank: int, world: int) -> float:
    """Mean loss over this rank's share of the validation windows, summed over ranks."""
    net.eval()
    count = len(range(s["val_samples"])[rank::world])
    windows = Windows(s["val"], s["block_size"], s["val_seed"], rank)
    total = torch.zeros(2, dtype=torch.float64)
    while count:
        x, y = windows.batch(min(count, s["val_batch"]))
        _, loss = net(x, y)
        total += torch.stack([loss.double() * len(y), torch.tensor(len(y), dtype=torch.float64)])
        count -= len(x)
    if world > 1:
        dist.all_reduce(total)
    net.train()
    return (total[0] / total[1]).item()


def main(argv: list[str]) -> None:
    s = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    torch.set_num_threads(1)
    ddp = "RANK" in os.environ
    if ddp:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    seed(s["seed"])
    raw = GPT(**s["net"])
    decay = [p for p in raw.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": s["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=s["lr"], betas=tuple(s["betas"]))
    net = DDP(raw) if ddp else raw
    seed(s["seed"] + rank)
    train = Windows(s["train"], s["block_size"], s["seed"], rank)
    micro = s["batch_size"] // world
    clock = {}
    for step in range(s["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s)
        for k in range(s["accum"]):
            x, y = train.batch(micro)
            last = k == s["accum"] - 1
            with nullcontext() if last or not ddp else net.no_sync():
                _, loss = net(x, y)
                (loss / s["accum"]).backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), s["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % s["log_every"] == 0:
            loss.item()  # the loss printed at a log point: the step is done here
            clock[step + 1] = time.perf_counter()
    result = {"val_loss": val_loss(net.module if ddp else net, s, rank, world), "clock": clock}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "final.json").write_text(json.dumps(result))
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

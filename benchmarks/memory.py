"""Per-rank memory of training state, DDP against FSDP (``strategy: fsdp``), at 1, 2 and 4 ranks.

Run:  python benchmarks/memory.py [--ranks 1 2 4] [--dim 256] [--depth 4] [--no-append]

Each configuration starts its ranks (gloo on the CPU; NCCL, one GPU per rank, with
``--device cuda``), wraps a :class:`~echelon3.nets.transformer.RowTransformer` as
``echelon3 train`` does (:func:`echelon3.distributed.ddp.wrap`,
:func:`echelon3.distributed.fsdp.shard`),
takes one AdamW step and counts the bytes each rank holds: its parameters, its
gradients and its optimizer state (for FSDP the local shards of the DTensors). On
a GPU it adds the peak CUDA memory of the step (``torch.cuda.max_memory_allocated``),
which includes activations and the gathered units. The largest rank is reported
(shards of uneven size differ by a row). Appends the table, dated, to RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import append_results  # noqa: E402

MIB = 2 ** 20


def nbytes(tensors) -> int:
    from echelon3.distributed.fsdp import local

    return sum(local(t).numel() * t.element_size() for t in tensors if t is not None)


def measure(strategy: str, dim: int, depth: int, device: torch.device) -> dict[str, int]:
    """One AdamW step of the wrapped network; this rank's bytes (a collective under W > 1)."""
    from echelon3.distributed import ddp, fsdp
    from echelon3.distributed.ranks import get_world_size
    from echelon3.nets.transformer import RowTransformer

    torch.manual_seed(0)
    net = RowTransformer(dim=dim, heads=4, depth=depth).to(device)
    world = get_world_size()
    if strategy == "fsdp":
        units = {"units": fsdp.fsdp_settings({"fsdp": {"units": ["TransformerBlock"]}})["units"],
                 "reshard_after_forward": True, "offload": False}
        model = fsdp.shard(net, device, world, units, "fp32")
    else:
        model = ddp.wrap(net, device, world, {"compile": False, **ddp.DDP_KEYS})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    x = torch.randn(32, 64, device=device)
    torch.nn.functional.cross_entropy(model(x), torch.arange(32, device=device) % 10).backward()
    optimizer.step()
    params = list(model.parameters())
    out = {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
           "optimizer": nbytes(v for s in optimizer.state.values() for v in s.values()
                               if torch.is_tensor(v) and v.dim()),
           "count": sum(p.numel() for p in net.parameters())}
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)
    return out


def _worker(rank: int, world: int, port: int, strategy: str, dim: int, depth: int,
            kind: str, result: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    device = torch.device(kind, rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        mine = measure(strategy, dim, depth, device)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            torch.save({k: max(r[k] for r in every) for k in mine}, result)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(strategy: str, world: int, dim: int, depth: int, kind: str) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(world, _free_port(), strategy, dim, depth, kind, result),
                 nprocs=world, join=True)
        return torch.load(result, weights_only=True)


def table(results: list[tuple[str, int, dict]], cuda: bool) -> list[str]:
    head = "| strategy | ranks | parameters MiB | gradients MiB | optimizer state MiB | " \
           "total MiB per rank | of DDP's |" + (" peak CUDA MiB |" if cuda else "")
    rows = [head, "|---" * (7 + cuda) + "|"]
    ddp = {world: r for name, world, r in results if name == "ddp"}
    for name, world, r in results:
        total = r["params"] + r["grads"] + r["optimizer"]
        base = ddp.get(world)
        ratio = total / (base["params"] + base["grads"] + base["optimizer"]) if base else 1.0
        rows.append(f"| {name} | {world} | {r['params'] / MIB:.2f} | {r['grads'] / MIB:.2f} | "
                    f"{r['optimizer'] / MIB:.2f} | {total / MIB:.2f} | {ratio:.2f} |"
                    + (f" {r['peak'] / MIB:.1f} |" if cuda else ""))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    worlds = [w for w in args.ranks if not cuda or w <= torch.cuda.device_count()]
    results = []
    for world in worlds:
        for strategy in ("ddp", "fsdp"):
            results.append((strategy, world, run(strategy, world, args.dim, args.depth,
                                                 args.device)))
            print(table(results, cuda)[-1], flush=True)
    count = results[0][2]["count"]
    text = "\n".join([f"RowTransformer(dim={args.dim}, depth={args.depth}): {count:,} fp32 "
                      f"parameters, AdamW, on {'the GPU' if cuda else 'the CPU'}.", "",
                      *table(results, cuda)])
    print(text)
    if not args.no_append:
        append_results("memory", text, argv)


if __name__ == "__main__":
    main()

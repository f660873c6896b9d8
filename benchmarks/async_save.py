"""How long a checkpoint save stops training, with ``target.async_save`` false and true.

A stack of Linear layers of about 100 M parameters with its AdamW state (one step
taken, so both moments exist) is saved several times through the
:class:`~echelon3.checkpoints.files.CheckpointManager`, in one process and at 2 gloo
ranks (2 processes, DDP-style: every rank holds the whole state, rank 0 writes the
file). Per save it measures:

- **training blocked**: from the call of ``save_checkpoint`` until training can go on
  (at 2 ranks, until every rank has passed the barrier after the call, as it would pass
  the next gradient all-reduce); synchronous, that is the whole write; async, the copy
  of the state to the CPU;
- **file complete**: from the call until the checkpoint is renamed into place
  (async: until ``wait()`` returns, with no training in between).

The median over the saves after the first (the first async save also allocates its
host buffers; its figure is given apart) goes into the table between
``<!-- async_save:start -->`` and ``<!-- async_save:end -->`` of docs/checkpoints.md,
dated, with the machine's core count and load.

    python benchmarks/async_save.py            # measure (about 100 M parameters), rewrite the page
    python benchmarks/async_save.py --print    # measure and print only
    python benchmarks/async_save.py --quick    # a tiny model, printed only (the tests run it)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAGE = REPO / "docs" / "checkpoints.md"
START, END = "<!-- async_save:start -->", "<!-- async_save:end -->"
FULL = {"width": 4096, "layers": 6, "saves": 4}  # 6 x (4096 x 4096 + 4096): 100.7 M
QUICK = {"width": 64, "layers": 2, "saves": 2}


def model_state(width: int, layers: int):
    """The checkpoint state of ``layers`` Linear(width, width) after one AdamW step."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    for param in net.parameters():
        param.grad = torch.full_like(param, 1e-3)
    optimizer.step()
    params = sum(p.numel() for p in net.parameters())
    return {"model_state_dict": net.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
            "epoch": 0, "global_step": 0}, params


def measure(folder: Path, async_save: bool, width: int, layers: int, saves: int) -> dict:
    """Seconds blocked and until complete, per save, on this rank (rank 0 reports)."""
    from echelon3.checkpoints.files import CheckpointManager
    from echelon3.distributed.ranks import barrier

    state, params = model_state(width, layers)
    manager = CheckpointManager(folder, checkpoints_to_keep=1, async_save=async_save)
    blocked, complete = [], []
    for epoch in range(1, saves + 1):
        barrier()
        started = time.perf_counter()
        manager.save_checkpoint({**state, "epoch": epoch}, epoch)
        barrier()
        blocked.append(time.perf_counter() - started)
        manager.wait()
        complete.append(time.perf_counter() - started)
        barrier()
    size = (folder / f"checkpoint-{saves}.tar").stat().st_size if (
        folder / f"checkpoint-{saves}.tar").exists() else 0
    return {"blocked": blocked, "complete": complete, "params": params, "bytes": size}


def _rank_worker(rank: int, folder: Path, async_save: bool, sizes: dict, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=rank,
                            world_size=2)
    try:
        result = measure(folder / "run", async_save, **sizes)
        if rank == 0:
            out.update(result)
    finally:
        dist.destroy_process_group()


def two_ranks(folder: Path, async_save: bool, sizes: dict) -> dict:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_worker, args=(folder, async_save, sizes, out), nprocs=2, join=True)
        return dict(out)


def _later(values: list[float]) -> float:
    """The median of the saves after the first (the only one if there is one)."""
    return statistics.median(values[1:] or values)


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 0.1 else f"{value * 1000:.1f} ms"


def row(ranks: int, async_save: bool, result: dict) -> str:
    mode = "`async_save: true`" if async_save else "`async_save: false`"
    return (f"| {ranks} | {mode} | {_seconds(_later(result['blocked']))} (first "
            f"{_seconds(result['blocked'][0])}) | {_seconds(_later(result['complete']))} |")


def table(rows: list[str], params: int, size: int, saves: int, load: tuple[float, float]) -> str:
    import torch

    header = ["| ranks | save | training blocked per save | until the file is complete |",
              "|---|---|---|---|"]
    note = (f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} CPU cores (load average "
            f"{load[0]:.1f} at the start, {load[1]:.1f} at the end), torch {torch.__version__}: "
            f"{params / 1e6:.1f} M parameters with their AdamW state, a {size / 1e9:.2f} GB "
            f"file, medians of saves 2 to {saves}, by one run of "
            "`python benchmarks/async_save.py` (it rewrites this table). On a shared "
            "machine the times vary with its load.")
    return "\n".join([*header, *rows, "", note])


def rewrite(page: Path, text: str) -> None:
    content = page.read_text()
    if START not in content or END not in content:
        sys.exit(f"{page}: no {START} ... {END} markers")
    before, rest = content.split(START, 1)
    _, after = rest.split(END, 1)
    page.write_text(f"{before}{START}\n{text}\n{END}{after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the table, leave the page")
    parser.add_argument("--quick", action="store_true", help="a tiny model; print only")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    load_start = os.getloadavg()[0]
    rows, params, size = [], 0, 0
    with tempfile.TemporaryDirectory(prefix="echelon3-async-save-") as tmp:
        for ranks in (1, 2):
            for async_save in (False, True):
                folder = Path(tmp) / f"{ranks}-{async_save}"
                folder.mkdir()
                result = measure(folder / "run", async_save, **sizes) if ranks == 1 \
                    else two_ranks(folder, async_save, sizes)
                rows.append(row(ranks, async_save, result))
                params, size = result["params"], result["bytes"]
                print(rows[-1], flush=True)
    text = table(rows, params, size, sizes["saves"], (load_start, os.getloadavg()[0]))
    print(text)
    if not (args.print or args.quick):
        rewrite(PAGE, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

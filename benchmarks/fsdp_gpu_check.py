"""GPU check of ``strategy: fsdp``: NCCL, the bf16 mixed-precision policy, sharded checkpoints.

Run on a machine with a CUDA GPU:  python benchmarks/fsdp_gpu_check.py   (a few minutes)

1. In this process, a NCCL group of one rank: a RowTransformer sharded by
   :func:`echelon3.distributed.fsdp.shard` under the ``bf16`` policy trains 30 AdamW steps.
   Rows: the sharded parameters and the optimizer state stay fp32 DTensors, a block's
   Linear computes in bf16, the sharded gradients arrive in fp32, the loss falls
   and stays within 0.1 of the same steps unsharded in fp32; a
   ``torch.distributed.checkpoint`` save and load round-trips the weights, and the
   consolidated state dict is unprefixed and equal to them.
2. ``echelon3 train -cn digits_transformer`` with ``precision: bf16`` over NCCL on 2
   GPUs (when there are 2), then ``echelon3 evaluate`` of its ``best.tar``; one GPU
   instead trains unsharded (nothing to shard in one process).
3. ``benchmarks/memory.py --device cuda``: peak CUDA memory, DDP against FSDP, at as
   many ranks (1, 2, 4) as there are GPUs; appended to RESULTS.md.

Exits 1 if a row fails, 0 otherwise; on a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchmarks.gpu_check as table  # noqa: E402
from benchmarks.gpu_check import row  # noqa: E402

STEPS = 30


def _train(net, device, steps: int = STEPS):
    torch.manual_seed(1)
    x = torch.randn(64, 64, device=device)
    y = torch.arange(64, device=device) % 10
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def check_policy(device, backend: str = "nccl") -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from echelon3.checkpoints.consolidate import consolidated
    from echelon3.distributed import fsdp
    from echelon3.nets.transformer import RowTransformer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group(backend, rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    torch.manual_seed(0)
    reference = RowTransformer(dim=64, depth=4).to(device)
    net = RowTransformer(dim=64, depth=4).to(device)
    net.load_state_dict(reference.state_dict())
    settings = fsdp.fsdp_settings({"fsdp": {"units": ["TransformerBlock"]}})
    fsdp.shard(net, device, 1, settings, "bf16")
    seen = {}
    net.blocks[0].mlp[0].register_forward_hook(
        lambda m, args, out: seen.setdefault("dtype", args[0].dtype) and None)
    losses, optimizer = _train(net, device)
    weight = net.blocks[0].mlp[0].weight
    row("fsdp params: DTensor, fp32", f"{type(weight).__name__}, {weight.dtype}",
        isinstance(weight, DTensor) and weight.dtype == torch.float32)
    row("fsdp block computes in", seen.get("dtype"), seen.get("dtype") == torch.bfloat16)
    net(torch.randn(8, 64, device=device)).sum().backward()
    row("fsdp sharded grad dtype", weight.grad.dtype, weight.grad.dtype == torch.float32)
    moment = optimizer.state[weight]["exp_avg"]
    row("fsdp optimizer state: DTensor, fp32", f"{type(moment).__name__}, {moment.dtype}",
        isinstance(moment, DTensor) and moment.dtype == torch.float32)
    ref_losses, _ = _train(reference, device)
    row("fsdp bf16 loss first -> last", f"{losses[0]:.3f} -> {losses[-1]:.3f}",
        losses[-1] < 0.5 * losses[0])
    gap = abs(losses[-1] - ref_losses[-1])
    row("fsdp bf16 vs unsharded fp32 final loss", f"{gap:.4f}", gap < 0.1)
    with tempfile.TemporaryDirectory() as tmp:
        saved = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
        dcp.save({"model": net.state_dict()}, checkpoint_id=tmp)
        for p in net.parameters():
            p.data.zero_()
        state = {"model": net.state_dict()}
        dcp.load(state, checkpoint_id=tmp)
        same = all(torch.equal(v.full_tensor(), saved[k]) for k, v in net.state_dict().items())
        row("fsdp dcp save -> load round trip", same, same)
    full = consolidated(net.state_dict())
    ok = full.keys() == saved.keys() and all(
        full[k].device.type == "cpu" and torch.equal(full[k], saved[k].cpu()) for k in full)
    row("fsdp consolidated: unprefixed, on CPU, equal", ok, ok)
    dist.destroy_process_group()


def check_train(gpus: int) -> None:
    cli = [sys.executable, "-m", "echelon3"]
    cd = str(REPO / "config" / "experiments")
    ids = "[0,1]" if gpus >= 2 else "[0]"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["-cd", cd, "-cn", "digits_transformer", f"gpus={ids}", f"target.path={tmp}",
                "trainer.config.precision=bf16", "trainer.config.epochs=5"]
        train = subprocess.run([*cli, "train", *args], capture_output=True, text=True)
        row(f"train digits_transformer fsdp gpus={ids}", train.returncode,
            train.returncode == 0)
        if train.returncode:
            print(train.stderr[-3000:])
            return
        sharded = sorted(p.name for p in Path(tmp, "checkpoint-5.dcp").glob("*.distcp"))
        row("  sharded checkpoint files", len(sharded), len(sharded) == min(gpus, 2))
        evaluate = subprocess.run([*cli, "evaluate", *args], capture_output=True, text=True)
        acc = json.loads(Path(tmp, "metrics.json").read_text()).get("accuracy", 0.0) \
            if evaluate.returncode == 0 else 0.0
        row("  evaluate best.tar accuracy", f"{acc:.4f}", acc >= 0.8)


def main() -> int:
    os.environ.setdefault("PYTHONPATH", str(REPO))
    if not torch.cuda.is_available():
        print("fsdp_gpu_check: no CUDA GPU on this machine; nothing to check")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(f"fsdp_gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{torch.cuda.device_count()} GPU(s)")
    for section in (lambda: check_policy(device), lambda: check_train(torch.cuda.device_count())):
        try:
            section()
        except Exception as e:  # keep going: one table with every row
            row("section crashed", f"{type(e).__name__}: {e}"[:60], False)
    memory = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory.py"),
                             "--device", "cuda"], capture_output=True, text=True)
    row("memory.py --device cuda", memory.returncode, memory.returncode == 0)
    print(memory.stdout[-2000:] if memory.returncode == 0 else memory.stderr[-2000:])
    print(f"fsdp_gpu_check: {len(table.rows)} rows, {table.failures} failed")
    return 1 if table.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

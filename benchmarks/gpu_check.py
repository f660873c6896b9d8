"""GPU checks for precision, TF32 and torch.compile, printed as one short table.

Run on a machine with a CUDA GPU:  python benchmarks/gpu_check.py
Every row is measured in this run; speed rows are ratios of two runs side by side.
The compile rows train through echelon3's own trainer (``echelon3 train``), as a
user would: eager against ``compile: true, compile_mode: reduce-overhead``.
The DDP row counts host syncs per step under 2-rank NCCL DDP (2 GPUs; with fewer it
says why it skipped). Exits 1 if a correctness row fails, 0 otherwise; on a machine
without CUDA it says so and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
rows: list[tuple[str, str, str]] = []
failures = 0


def row(name: str, value, ok: bool | None = None) -> None:
    global failures
    status = "" if ok is None else ("ok" if ok else "FAIL")
    failures += ok is False
    rows.append((name, str(value), status))
    print(f"  {name:<44} {value!s:<28} {status}", flush=True)


def timed(fn, repeat: int) -> float:
    for _ in range(3):
        fn()  # warm-up (autotuning, compilation)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def check_precision(device) -> None:
    from echelon3.distributed.precision import Precision, resolve_mode

    row("bf16 supported", torch.cuda.is_bf16_supported())
    auto = resolve_mode("auto", device)
    row("precision auto ->", auto, auto == ("bf16" if torch.cuda.is_bf16_supported() else "fp32"))
    layer = torch.nn.Linear(64, 64).to(device)
    x = torch.randn(8, 64, device=device)
    for mode, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                        ("fp32", torch.float32)):
        with Precision(mode, device).autocast():
            got = layer(x).dtype
        row(f"autocast {mode} output dtype", str(got).replace("torch.", ""), got == dtype)
    p = Precision.from_config(device, "fp16", tf32=True, cudnn_benchmark=True)
    row("fp16 GradScaler present", p.scaler is not None, p.scaler is not None)
    row("tf32 on (matmul / cudnn)", f"{torch.backends.cuda.matmul.allow_tf32} / "
        f"{torch.backends.cudnn.allow_tf32}", torch.backends.cuda.matmul.allow_tf32)


def check_matmul_speed(device) -> None:
    n = 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = timed(lambda: a @ b, 10)
    torch.backends.cuda.matmul.allow_tf32 = True
    tf32 = timed(lambda: a @ b, 10)

    def bf16():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return a @ b

    half = timed(bf16, 10)
    flops = 2 * n ** 3
    row("matmul 8192 fp32 TFLOP/s", f"{flops / fp32 / 1e12:.1f}")
    row("matmul speed-up tf32 / fp32", f"{fp32 / tf32:.2f}x", fp32 / tf32 > 1.2)
    row("matmul speed-up bf16 / fp32", f"{fp32 / half:.2f}x", fp32 / half > 1.5)


def trainer_steps(device: str, extra: list[str], smoke: bool = False) -> dict:
    """``echelon3 train`` on the tiny-MLP row of ``workloads.py``, on ``device``: the
    steady-state ms per step (epochs 2.., validation and checkpoint left out, best epoch)
    and the graphs torch.compile compiled per epoch, from the run's ``time`` records."""
    from benchmarks.parity import echelon3_config
    from benchmarks.workloads import workloads

    w = next(v for v in workloads(smoke).values() if "tiny MLP" in v.name and
             v.device == ("cuda" if device == "cuda" else "cpu"))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        target = Path(tmp) / "run"
        cfg = echelon3_config(w, target)
        cfg["trainer"]["config"]["epochs"] = 3
        (Path(tmp) / "tiny.yaml").write_text(yaml.safe_dump(cfg))
        done = subprocess.run([sys.executable, "-m", "echelon3", "train", "-cd", tmp, "-cn",
                               "tiny", *extra], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        records = [json.loads(line) for line in (target / "history.jsonl").open()]
    times = [r for r in records if r["split"] == "time"]
    per_step = [1e3 * r["epoch_s"] * (1 - r["validation_checkpoint"]) / r["steps"]
                for r in times[1:]]
    return {"ms": min(per_step), "compiles": [r.get("compiles", 0) for r in times]}


def check_compile_speed(device) -> None:
    """The launch-bound tiny MLP through echelon3's own trainer: eager against
    ``compile: true, compile_mode: reduce-overhead``, steady state, recompiles counted."""
    eager = trainer_steps("cuda", [])
    row("trainer step eager, tiny MLP (ms)", f"{eager['ms']:.3f}")
    compiled = trainer_steps("cuda", ["trainer.config.compile=true",
                                      "trainer.config.compile_mode=reduce-overhead"])
    speedup = eager["ms"] / compiled["ms"]
    row("trainer step compiled reduce-overhead (ms)", f"{compiled['ms']:.3f}")
    row("compiled / eager speed (goal >= 1.5x)", f"{speedup:.2f}x", speedup >= 1.5)
    warm, later = compiled["compiles"][0], compiled["compiles"][1:]
    row("graphs compiled: epoch 1 / after", f"{warm} / {sum(later)}", sum(later) == 0)


def check_ddp_host_syncs() -> None:
    """Host syncs per optimizer step under 2-rank NCCL DDP, counted in each rank
    (:mod:`benchmarks.sync_count`): the hot loop reads the device only at log points,
    so the count per step stays under 2 (goal: < 2 per step). The window, steps 11-40
    of epoch 1, holds one log point."""
    if torch.cuda.device_count() < 2:
        row("DDP NCCL host syncs / step", f"skipped: needs 2 GPUs, "
            f"{torch.cuda.device_count()} visible")
        return
    from benchmarks.parity import echelon3_config
    from benchmarks.workloads import workloads

    w = next(v for v in workloads(True).values() if v.name.startswith("GPU: tiny MLP"))
    with tempfile.TemporaryDirectory(prefix="gpu-check-ddp-") as tmp:
        cfg = echelon3_config(w, Path(tmp) / "run")
        cfg.update(gpus=[0, 1], net={"module": "benchmarks.sync_count",
                                     "type": "SyncCountedMLP",
                                     "config": dict(w.net["config"], warm=10, steps=30)})
        cfg["trainer"]["config"].update(epochs=2, log_every_n_steps=25)
        (Path(tmp) / "ddp.yaml").write_text(yaml.safe_dump(cfg))
        done = subprocess.run([sys.executable, "-m", "echelon3", "train", "-cd", tmp, "-cn",
                               "ddp"], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO), SYNC_COUNT_DIR=tmp))
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        counts = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    per_step = max(c["syncs"] / c["steps"] for c in counts)
    row("DDP NCCL host syncs / step (max rank)", f"{per_step:.2f} over {len(counts)} ranks",
        len(counts) == 2 and per_step < 2)


def check_end_to_end() -> None:
    """The digits CNN through the real CLI on the GPU: default precision, fp16, compile."""
    cli = [sys.executable, "-m", "echelon3"]
    cd = str(REPO / "config" / "experiments")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"auto": [], "fp16": ["trainer.config.precision=fp16"],
                "compile": ["trainer.config.compile=true"]}
        for name, extra in runs.items():
            target = Path(tmp) / name
            start = time.perf_counter()
            train = subprocess.run([*cli, "train", "-cd", cd, "-cn", "digits_cnn", "gpus=[0]",
                                    f"target.path={target}", *extra], capture_output=True,
                                   text=True)
            seconds = time.perf_counter() - start
            ok = train.returncode == 0
            used = [line for line in train.stderr.splitlines() if "training on" in line]
            row(f"train digits_cnn [{name}] wall s", f"{seconds:.1f}", ok)
            if not ok:
                print(train.stderr[-2000:])
                continue
            row(f"  [{name}] startup line", used[0].split("] ", 1)[-1][:28] if used else "?")
            evaluate = subprocess.run([*cli, "evaluate", "-cd", cd, "-cn", "digits_cnn",
                                       "gpus=[0]", f"target.path={target}"],
                                      capture_output=True, text=True)
            metrics = json.loads((target / "metrics.json").read_text()) \
                if evaluate.returncode == 0 else {}
            acc = metrics.get("accuracy", 0.0)
            row(f"  [{name}] test accuracy", f"{acc:.4f}", acc >= 0.95)
            state = torch.load(target / "best.tar", weights_only=True)
            clean = not any(k.startswith(("module.", "_orig_mod."))
                            for k in state["model_state_dict"])
            row(f"  [{name}] checkpoint keys unprefixed", clean, clean)
            if name == "fp16":
                scaler = state.get("scaler_state_dict") or {}
                row("  [fp16] scaler state saved", "scale" in scaler, "scale" in scaler)


def main() -> int:
    os.environ.setdefault("PYTHONPATH", str(REPO))
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check")
        return 0
    device = torch.device("cuda", 0)
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{torch.cuda.device_count()} GPU(s)")
    print(f"  {'check':<44} {'value':<28} status")
    for section in (check_precision, check_matmul_speed, check_compile_speed,
                    check_ddp_host_syncs):
        try:
            section(device)
        except Exception as e:  # keep going: one table with every row
            row(f"{section.__name__} crashed", f"{type(e).__name__}: {e}"[:60], False)
    check_end_to_end()
    print(f"gpu_check: {len(rows)} rows, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""echelon3 against a hand-written nanoGPT-style loop, on the character GPT, side by side.

    python benchmarks/gpt_loop.py [--steps 300] [--accum 2] [--runs 2] [--smoke] [--no-append]

Both sides train the same network (``echelon3.nets.gpt.GPT`` as config/experiments/
char_gpt.yaml builds it) on the same token files (the pydoc topics, prepared in a
temporary folder by ``echelon3.datasets.char_text``) with the same recipe: AdamW decaying
2-D tensors only, linear warmup then cosine per step, clipping, ``--accum`` micro-batches
per optimizer step, fp32 on the CPU, one thread per rank. The hand-written side is
``gpt_handwritten.py``; the echelon3 side is ``echelon3 train`` on char_gpt.yaml with the
same overrides. At 1 process and at 2 (both started by torchrun, DDP over gloo) the sides
alternate, A/B then B/A. Step time is the steady state: from the log point at a fifth of
the run to the last log point before its end, excluding the first steps and the final
validation. The final validation loss of each side is shown beside it (fp32, the same
windows and initial weights: equal up to rounding). The table goes to stdout and, with the
machine, date and command, to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import append_results  # noqa: E402
from echelon3.observe.loggers import DefaultLogger  # noqa: E402

CONFIG_DIR = REPO / "config" / "experiments"
SMALL = ("net.config.n_layer=1", "net.config.n_embd=32", "net.config.block_size=16",
         "data.train.config.block_size=16", "data.val.config.block_size=16",
         "data.val.config.samples=16", "scheduler.config.milestones=[2]",
         "scheduler.config.schedulers.0.config.total_iters=2",
         "scheduler.config.schedulers.1.config.T_max=total_steps - 2")


class TimedLogger(DefaultLogger):
    """echelon3's history, each record stamped with this process's clock when logged."""

    def log(self, record: dict) -> None:
        super().log({**record, "wall": time.perf_counter()})


def overrides(data: Path, args) -> list[str]:
    """What both sides train: char_gpt.yaml, cut to the benchmark's length, in fp32."""
    every = args.log_every
    return ["device=cpu", f"trainer.config.max_steps={args.steps}",
            f"trainer.config.val_check_interval={args.steps}",
            f"trainer.config.grad_accum_steps={args.accum}",
            f"trainer.config.log_every_n_steps={every}", "trainer.config.precision=fp32",
            f"data.train.config.path={data / 'train.bin'}",
            f"data.val.config.path={data / 'val.bin'}", "target.every_n_steps=null",
            "mlops.module=benchmarks.gpt_loop", "mlops.type=TimedLogger",
            "mlops.config.tensorboard=false", *(SMALL if args.smoke else ())]


def settings(extra: list[str]) -> dict:
    """The composed char_gpt.yaml, as the hand-written loop reads it."""
    from omegaconf import OmegaConf

    from echelon3.config.compose import load_config

    cfg = OmegaConf.to_container(load_config(CONFIG_DIR, "char_gpt", extra).cfg, resolve=True)
    trainer, opt = cfg["trainer"]["config"], cfg["optimizer"]
    warmup, cosine = cfg["scheduler"]["config"]["schedulers"]
    steps_to_warm = cfg["scheduler"]["config"]["milestones"][0]
    # The hand-written schedule is this shape; refuse a config that has drifted from it.
    assert cfg["scheduler"]["type"] == "SequentialLR" and opt["no_decay"] == {"ndim_below": 2}
    assert warmup["config"]["total_iters"] == steps_to_warm
    assert cosine["config"]["T_max"].replace(" ", "") == f"total_steps-{steps_to_warm}"
    train, val = cfg["data"]["train"]["config"], cfg["data"]["val"]["config"]
    return {"seed": cfg["seed"], "net": cfg["net"]["config"], "train": train["path"],
            "val": val["path"], "block_size": train["block_size"],
            "val_samples": val["samples"], "val_seed": val["seed"],
            "val_batch": cfg["dataloaders"]["test"]["config"]["batch_size"],
            "batch_size": cfg["dataloaders"]["train"]["config"]["batch_size"],
            "accum": trainer["grad_accum_steps"], "steps": trainer["max_steps"],
            "log_every": trainer["log_every_n_steps"], "clip": trainer["gradient_clip_val"],
            "lr": opt["config"]["lr"], "betas": opt["config"]["betas"],
            "weight_decay": opt["config"]["weight_decay"], "warmup": steps_to_warm,
            "start_factor": warmup["config"]["start_factor"],
            "min_lr": cosine["config"]["eta_min"]}


def steady(clock: dict[int, float], steps: int, every: int) -> float:
    """Seconds per step between the log point at a fifth of the run and the last one
    before its end."""
    points = sorted(clock)
    start = next(p for p in points if p >= steps // 5)
    end = max(p for p in points if p < steps) if points[-1] >= steps else points[-1]
    return (clock[end] - clock[start]) / (end - start)


def run_side(side: str, procs: int, work: Path, extra: list[str], s: dict) -> dict:
    out = work / f"{side}-{procs}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    launch = [sys.executable]
    if procs > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    if side == "hand":
        settings_file = work / "settings.json"
        settings_file.write_text(json.dumps(s))
        cmd = [*launch, str(REPO / "benchmarks" / "gpt_handwritten.py"), str(settings_file),
               str(out)]
    else:
        cmd = [*launch, "-m", "echelon3", "train", "-cd", str(CONFIG_DIR), "-cn", "char_gpt",
               *extra, f"target.path={out}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{side} at {procs} process(es) failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    if side == "hand":
        final = json.loads((out / "final.json").read_text())
        clock, loss = {int(k): v for k, v in final["clock"].items()}, final["val_loss"]
    else:
        records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
        clock = {r["step"]: r["wall"] for r in records if r["split"] == "train"}
        loss = [r for r in records if r["split"] == "val"][-1]["loss"]
    return {"step_s": steady(clock, s["steps"], s["log_every"]), "loss": loss}


def measure(procs: int, runs: int, work: Path, extra: list[str], s: dict) -> dict:
    results: dict[str, list[dict]] = {"hand": [], "echelon3": []}
    for k in range(runs):
        for side in ("hand", "echelon3") if k % 2 == 0 else ("echelon3", "hand"):
            results[side].append(run_side(side, procs, work, extra, s))
            print(f"{procs} process(es), {side}: {results[side][-1]['step_s'] * 1000:.1f} "
                  f"ms/step, val loss {results[side][-1]['loss']:.6f}", flush=True)
    hand = [r["step_s"] for r in results["hand"]]
    ours = [r["step_s"] for r in results["echelon3"]]
    loss_hand, loss_ours = results["hand"][-1]["loss"], results["echelon3"][-1]["loss"]
    return {"procs": procs, "hand": (min(hand), statistics.median(hand)),
            "ours": (min(ours), statistics.median(ours)),
            "ratio": (min(ours) / min(hand), statistics.median(ours) / statistics.median(hand)),
            "loss_hand": loss_hand, "loss_ours": loss_ours,
            "same": abs(loss_hand - loss_ours) <= 1e-4 * max(1.0, abs(loss_hand))}


def table(rows: list[dict], args, s: dict) -> str:
    lines = ["| processes | hand-written ms/step (min / median) | echelon3 ms/step "
             "(min / median) | **ratio (min)** | ratio (median) | final val loss: "
             "hand-written / echelon3 | same (fp32) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['procs']} | {r['hand'][0] * 1000:.1f} / {r['hand'][1] * 1000:.1f} "
            f"| {r['ours'][0] * 1000:.1f} / {r['ours'][1] * 1000:.1f} "
            f"| **{r['ratio'][0]:.3f}** | {r['ratio'][1]:.3f} "
            f"| {r['loss_hand']:.6f} / {r['loss_ours']:.6f} | {'yes' if r['same'] else 'NO'} |")
    net = s["net"]
    lines.append(
        f"\nGPT {net['n_layer']} layers x {net['n_embd']} wide, block {s['block_size']}, "
        f"vocab {net['vocab_size']}; {s['steps']} optimizer steps of {s['accum']} "
        f"micro-batches of {s['batch_size']} windows (global); fp32, OMP_NUM_THREADS=1 per "
        f"rank; {args.runs} A/B-alternated runs per side; steady state from step "
        f"{s['steps'] // 5} to the last log point (every {s['log_every']} steps) before the "
        "end. 2 processes: torchrun, DDP over gloo, `no_sync` inside accumulation windows; "
        "each rank draws its own windows, so the losses at 1 and 2 processes differ.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (300)")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step (2)")
    parser.add_argument("--log-every", type=int, default=10, help="steps between log points")
    parser.add_argument("--runs", type=int, default=2, help="runs per side (default 2: A/B, B/A)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2],
                        help="process counts (default 1 2)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny GPT, 6 steps, one run per side: a correctness run")
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.log_every, args.runs = 6, 1, 1
    from echelon3.datasets.char_text import prepare

    with tempfile.TemporaryDirectory(prefix="gpt-loop-") as tmp:
        work = Path(tmp)
        prepare(work / "data")
        extra = overrides(work / "data", args)
        s = settings(extra)
        rows = [measure(procs, args.runs, work, extra, s) for procs in args.procs]
    text = table(rows, args, s)
    print(text)
    if not args.no_append:
        append_results("gpt_loop", text, argv)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

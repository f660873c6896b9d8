"""echelon3 against the loop a researcher writes by hand, on the same work, side by side.

    python benchmarks/parity.py [--runs 3] [--rows MLP] [--hog] [--smoke] [--no-append]

For each row of ``workloads.py`` the hand-written loop (``handwritten.py``) and
``echelon3 train`` run alternately (A/B, then B/A, ...). The time per epoch is
the steady state: from the end of epoch 1 to the end of the last epoch, read
from the mtimes of the per-epoch checkpoints, divided by the epochs in between.
Both must reach the same validation loss in fp32 (same seed). The table goes to
stdout and, with the machine, date and command, is appended to
``benchmarks/RESULTS.md``. GPU rows run when CUDA is present, else say "no GPU".

The DDP row (2 gloo ranks: ``echelon3 train`` with ``nproc: 2`` against
``handwritten_ddp.py`` under torchrun, :mod:`benchmarks.parity_ddp`) runs quiet and,
with ``--hog``, again beside one bounded busy loop per core, with where each side's
CPU went (launcher, ranks, helpers).
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

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import append_results, cuda_available, machine_info  # noqa: E402
from benchmarks.parity_ddp import ddp_table, measure_ddp  # noqa: E402
from benchmarks.workloads import Workload, ddp_workload, workloads  # noqa: E402


def echelon3_config(w: Workload, target: Path) -> dict:
    """The workload as an echelon3 run config."""
    test = dict(w.data, config=dict(w.data["config"], split="test",
                                    **({"size": w.test_size} if w.test_size else {})))
    loader = {"num_workers": w.num_workers, "pin_memory": w.pin_memory}
    metric_types = {"accuracy": ("MulticlassAccuracy", "micro"),
                    "macro_f1": ("MulticlassF1Score", "macro")}
    return {
        "seed": 0, **({"device": "cpu"} if w.device == "cpu" else {"gpus": [0]}),
        "net": w.net, "data": {"train": w.data, "test": test},
        "dataloaders": {
            "train": {"module": "torch.utils.data", "type": "DataLoader",
                      "config": {"batch_size": w.batch_size, "shuffle": True,
                                 "drop_last": w.drop_last, **loader}},
            "test": {"module": "torch.utils.data", "type": "DataLoader",
                     "config": {"batch_size": w.test_batch_size, **loader}}},
        "loss": [{"ce": {"module": "torch.nn", "type": "CrossEntropyLoss", "weight": 1.0}}],
        "metrics": [{m: {"module": "torchmetrics.classification", "type": metric_types[m][0],
                         "config": {"num_classes": 10, "average": metric_types[m][1]}}}
                    for m in w.metrics],
        "optimizer": w.optimizer, "scheduler": w.scheduler,
        "trainer": {"module": "echelon3.trainers.baseline", "type": "Trainer",
                    "config": {"epochs": w.epochs, "precision": w.precision,
                               "keep_best_on": "accuracy", **w.trainer_extra}},
        "target": {"path": str(target), "checkpoints_to_keep": w.epochs},
    }


def steady_epoch_seconds(folder: Path, epochs: int) -> float:
    """Seconds per epoch from the end of epoch 1 to the end of the last one."""
    times = [(folder / f"checkpoint-{e}.tar").stat().st_mtime for e in (1, epochs)]
    return (times[1] - times[0]) / (epochs - 1)


def run_side(side: str, w: Workload, work: Path, smoke: bool, threads: int) -> dict:
    """One run: steady wall and CPU seconds per epoch, final validation loss, echelon3's
    lever line and where its last epoch's time went."""
    out = work / f"{side}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if side == "hand":
        cmd = [sys.executable, str(REPO / "benchmarks" / "handwritten.py"), w.name, str(out)]
        cmd += ["--smoke"] if smoke else []
    else:
        config = work / "parity.yaml"
        config.write_text(yaml.safe_dump(echelon3_config(w, out)))
        cmd = [sys.executable, "-m", "echelon3", "train", "-cd", str(work), "-cn", "parity"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = {"wall": steady_epoch_seconds(out, w.epochs), "lever": "", "report": None}
    if side == "hand":
        final = json.loads((out / "final.json").read_text())
        cpu = final["cpu_at_epoch_end"]
        result.update(loss=final["loss"], cpu=(cpu[-1] - cpu[0]) / (w.epochs - 1))
    else:
        records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
        times = [r for r in records if r["split"] == "time"]
        result.update(loss=[r for r in records if r["split"] == "val"][-1]["loss"],
                      cpu=statistics.fmean(r["cpu_s"] for r in times[1:]), report=times[-1])
        lines = [line for line in done.stderr.splitlines() if "-bound: " in line]
        result["lever"] = lines[-1].split("] ", 1)[-1] if lines else ""
    return result


def measure(w: Workload, runs: int, smoke: bool, threads: int) -> dict:
    results: dict[str, list[dict]] = {"hand": [], "echelon3": []}
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        for k in range(runs):
            order = ("hand", "echelon3") if k % 2 == 0 else ("echelon3", "hand")
            for side in order:
                results[side].append(run_side(side, w, Path(tmp), smoke, threads))
    hand, ours = results["hand"], results["echelon3"]
    row = {"row": w.name, "loss_hand": hand[-1]["loss"], "loss_ours": ours[-1]["loss"],
           "lever": next((r["lever"] for r in ours if r["lever"]), ""),
           "report": ours[-1]["report"]}
    for key in ("wall", "cpu"):
        a, b = [r[key] for r in hand], [r[key] for r in ours]
        row.update({f"hand_{key}": (min(a), statistics.median(a)),
                    f"ours_{key}": (min(b), statistics.median(b)),
                    f"ratio_{key}": (min(b) / min(a),
                                     statistics.median(b) / statistics.median(a))})
    same = abs(row["loss_hand"] - row["loss_ours"]) <= 1e-5 * max(1.0, abs(row["loss_hand"]))
    row["same_loss"] = same if w.precision == "fp32" else None
    return row


def table(results: list[dict], runs: int, threads: int) -> str:
    lines = ["| workload | hand-written s/epoch: wall (min / median), CPU (min) "
             "| echelon3 s/epoch: wall (min / median), CPU (min) | **ratio wall min** "
             "| ratio wall median | ratio CPU min | same final loss (fp32) "
             "| echelon3's last epoch: data / step / overhead / val+ckpt |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['row']} | {r['skipped']} | | | | | | |")
            continue
        same = {True: "yes", False: "NO", None: "n/a (bf16)"}[r["same_loss"]]
        rep = r["report"] or {}
        shares = " / ".join(f"{rep.get(k, 0):.1%}" for k in
                            ("data_wait", "train_step", "overhead", "validation_checkpoint"))
        lines.append(
            f"| {r['row']} | {r['hand_wall'][0]:.3f} / {r['hand_wall'][1]:.3f}, "
            f"{r['hand_cpu'][0]:.3f} | {r['ours_wall'][0]:.3f} / {r['ours_wall'][1]:.3f}, "
            f"{r['ours_cpu'][0]:.3f} | **{r['ratio_wall'][0]:.3f}** | {r['ratio_wall'][1]:.3f} "
            f"| {r['ratio_cpu'][0]:.3f} | {same} ({r['loss_ours']:.6f}) | {shares} |")
    lines.append(f"\n{runs} A/B-alternated runs per side; steady state = epochs 2..E; "
                 f"OMP_NUM_THREADS={threads or 'default'}. Wall: from the checkpoint mtimes; "
                 "CPU: the process's CPU seconds per steady epoch.")
    levers = [f"- {r['row']}: {r['lever']}" for r in results if r.get("lever")]
    if levers:
        lines.append("\nechelon3's lever lines:\n" + "\n".join(levers))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument("--rows", default="", help="only rows whose name contains this")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS for both sides (default 1: steady on a shared "
                        "machine; 0 leaves torch's default)")
    parser.add_argument("--hog", action="store_true",
                        help="also run the DDP row beside a CPU hog on every core")
    parser.add_argument("--smoke", action="store_true", help="tiny rows: a correctness run")
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    results = []
    for w in workloads(args.smoke).values():
        if args.rows.lower() not in w.name.lower():
            continue
        if w.device == "cuda" and not cuda_available():
            results.append({"row": w.name, "skipped": "no GPU"})
            print(f"{w.name}: no GPU", flush=True)
            continue
        results.append(measure(w, args.runs, args.smoke, args.threads))
        print(f"{w.name}: ratio wall {results[-1]['ratio_wall'][0]:.3f}, "
              f"CPU {results[-1]['ratio_cpu'][0]:.3f}", flush=True)
    ddp = ddp_rows(args)
    text = table(results, args.runs, args.threads) if results else ""
    text += ("\n\n" if text and ddp else "") + (ddp_table(ddp, args.runs) if ddp else "")
    print(text)
    if not args.no_append:
        append_results("parity", text, argv)
    failed = [r for r in results + ddp if r.get("same_loss") is False]
    return 1 if failed else 0


def ddp_rows(args) -> list[dict]:
    """The DDP row quiet, and beside the hog with ``--hog``."""
    w = ddp_workload(args.smoke)
    if args.rows.lower() not in w.name.lower():
        return []
    rows = []
    with tempfile.TemporaryDirectory(prefix="parity-ddp-") as tmp:
        for busy in (False, True) if args.hog else (False,):
            rows.append(measure_ddp(w, args.runs, args.smoke, busy, Path(tmp)))
            print(f"{rows[-1]['row']}: ratio wall {rows[-1]['ratio_wall'][0]:.3f}, "
                  f"CPU {rows[-1]['ratio_cpu']:.3f}", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

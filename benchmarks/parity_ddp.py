"""``parity.py``'s DDP rows: 2 gloo ranks under echelon3 against the hand-written loop
under torchrun, quiet and beside a CPU hog, with where each side's CPU went.

Each launcher keeps its own default thread count (``OMP_NUM_THREADS`` is not set):
what a user gets. Wall: seconds per steady epoch (epochs 2..E, checkpoint mtimes).
CPU: per steady epoch and role (the launcher process, the ranks, other helpers),
sampled from ``/proc`` (:mod:`benchmarks.contention`), plus the whole run's CPU from
the kernel's count of waited-for children.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

from benchmarks.contention import hog, run_sampled
from benchmarks.workloads import Workload

REPO = Path(__file__).resolve().parents[1]
ROLES = ("launcher", "worker", "other")


def _command(side: str, w: Workload, work: Path, out: Path, smoke: bool) -> list[str]:
    if side == "hand":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(w.nproc), str(REPO / "benchmarks" / "handwritten_ddp.py"),
                str(out), *(["--smoke"] if smoke else [])]
    from benchmarks.parity import echelon3_config

    config = dict(echelon3_config(w, out), nproc=w.nproc)
    (work / "parity_ddp.yaml").write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "echelon3", "train", "-cd", str(work), "-cn", "parity_ddp"]


def _final_loss(side: str, out: Path) -> float:
    if side == "hand":
        return json.loads((out / "final.json").read_text())["loss"]
    records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "val"][-1]["loss"]


def run_ddp_side(side: str, w: Workload, work: Path, smoke: bool, busy: bool) -> dict:
    """One run: steady wall s/epoch, CPU s/epoch by role, the whole tree's CPU s, loss."""
    out = work / f"{side}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    marks = ("handwritten_ddp.py",) if side == "hand" else ("spawn_main",)
    with hog(busy):
        done, tree, total_cpu = run_sampled(_command(side, w, work, out, smoke), marks,
                                            cwd=REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{side} (DDP) failed ({done.returncode}):\n{done.stderr[-3000:]}")
    first, last = ((out / f"checkpoint-{e}.tar").stat().st_mtime for e in (1, w.epochs))
    epochs = w.epochs - 1
    roles = tree.between(first, last)
    per_epoch = {role: {k: v / epochs if k in ("cpu", "voluntary", "involuntary") else v
                        for k, v in roles.get(role, {}).items()} for role in ROLES}
    return {"wall": (last - first) / epochs, "roles": per_epoch, "total_cpu": total_cpu,
            "loss": _final_loss(side, out)}


def measure_ddp(w: Workload, runs: int, smoke: bool, busy: bool, work: Path) -> dict:
    """A/B-alternated runs of both sides; the medians, and the ratios of echelon3's to the
    hand-written loop's."""
    results: dict[str, list[dict]] = {"hand": [], "echelon3": []}
    for k in range(runs):
        for side in (("hand", "echelon3") if k % 2 == 0 else ("echelon3", "hand")):
            results[side].append(run_ddp_side(side, w, work, smoke, busy))
    row = {"row": w.name + (", CPU hog on every core" if busy else ", quiet"), "busy": busy}
    for side, rs in results.items():
        row[side] = {
            "wall": (min(r["wall"] for r in rs), statistics.median(r["wall"] for r in rs)),
            "total_cpu": statistics.median(r["total_cpu"] for r in rs),
            "loss": rs[-1]["loss"],
            "roles": {role: {key: statistics.median(r["roles"][role].get(key, 0) for r in rs)
                             for key in ("cpu", "processes", "threads", "voluntary",
                                         "involuntary")} for role in ROLES}}
    hand, ours = row["hand"], row["echelon3"]
    row["ratio_wall"] = (ours["wall"][0] / hand["wall"][0], ours["wall"][1] / hand["wall"][1])
    row["ratio_cpu"] = (sum(ours["roles"][r]["cpu"] for r in ROLES) /
                        max(1e-9, sum(hand["roles"][r]["cpu"] for r in ROLES)))
    row["same_loss"] = abs(hand["loss"] - ours["loss"]) <= 1e-4 * max(1.0, abs(hand["loss"]))
    return row


def ddp_table(rows: list[dict], runs: int) -> str:
    """The ratios, then where the CPU went, per side and role."""
    lines = ["| DDP row | hand-written (torchrun) s/epoch: wall min / median "
             "| echelon3 s/epoch: wall min / median | **ratio wall min** | ratio wall median "
             "| ratio CPU (all processes, steady) | same final loss |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        h, o = r["hand"]["wall"], r["echelon3"]["wall"]
        lines.append(f"| {r['row']} | {h[0]:.3f} / {h[1]:.3f} | {o[0]:.3f} / {o[1]:.3f} "
                     f"| **{r['ratio_wall'][0]:.3f}** | {r['ratio_wall'][1]:.3f} "
                     f"| {r['ratio_cpu']:.3f} | {'yes' if r['same_loss'] else 'NO'} "
                     f"({r['echelon3']['loss']:.6f} vs {r['hand']['loss']:.6f}) |")
    lines += ["", "Where the CPU went, per steady epoch (medians): CPU s, context switches "
              "(voluntary / involuntary), processes x most threads in one; the whole run's "
              "CPU s from the kernel (start-up included).", "",
              "| DDP row | side | launcher | ranks | other | whole run CPU s |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        for side in ("hand", "echelon3"):
            cells = []
            for role in ROLES:
                x = r[side]["roles"][role]
                cells.append(f"{x['cpu']:.3f} s, {x['voluntary']:.0f} / {x['involuntary']:.0f}, "
                             f"{x['processes']:.0f} x {x['threads']:.0f}" if x["processes"]
                             else "-")
            name = "hand-written" if side == "hand" else "echelon3"
            lines.append(f"| {r['row']} | {name} | {' | '.join(cells)} "
                         f"| {r[side]['total_cpu']:.2f} |")
    lines.append(f"\n{runs} A/B-alternated runs per side; --hog: one bounded busy loop per "
                 "core beside each run; OMP_NUM_THREADS left to each launcher.")
    return "\n".join(lines)

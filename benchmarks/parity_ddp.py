"""``parity.py``'s DDP rows: 2 gloo ranks under echelon3 against the hand-written loop
under torchrun, quiet and beside a CPU hog, with where each side's CPU went.

Four sides, A/B-alternated: the hand-written loop (DDP with its own defaults), echelon3
with its defaults (``ddp_find_unused_parameters: true``: DDP searches the autograd graph
for unused parameters every step), the hand-written loop with that same search
(``find_unused_parameters=True``), and echelon3 with the search off. The ratios compare
like with like: each echelon3 side against the hand-written loop whose DDP does the same
(the plain hand-written loop is the baseline of the table's first ratio column).

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
COUNTERS = ("cpu", "run_delay", "voluntary", "involuntary")  # per role, summed over an epoch
SIDES = {"hand": "hand-written (torchrun)", "echelon3": "echelon3 (defaults)",
         "hand_fu": "hand-written, find_unused_parameters=True",
         "echelon3_nofu": "echelon3, ddp_find_unused_parameters: false"}
LIKE = {"echelon3": "hand_fu", "echelon3_nofu": "hand"}  # the same DDP, hand-written


def _command(side: str, w: Workload, work: Path, out: Path, smoke: bool) -> list[str]:
    if side.startswith("hand"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(w.nproc), str(REPO / "benchmarks" / "handwritten_ddp.py"),
                str(out), *(["--smoke"] if smoke else []),
                *(["--find-unused"] if side == "hand_fu" else [])]
    from benchmarks.parity import echelon3_config

    config = dict(echelon3_config(w, out), nproc=w.nproc)
    if side == "echelon3_nofu":
        config["trainer"]["config"]["ddp_find_unused_parameters"] = False
    (work / "parity_ddp.yaml").write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "echelon3", "train", "-cd", str(work), "-cn", "parity_ddp"]


def _final_loss(side: str, out: Path) -> float:
    if side.startswith("hand"):
        return json.loads((out / "final.json").read_text())["loss"]
    records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "val"][-1]["loss"]


def run_ddp_side(side: str, w: Workload, work: Path, smoke: bool, busy: bool) -> dict:
    """One run: steady wall s/epoch, CPU s/epoch by role, the whole tree's CPU s, loss."""
    out = work / f"{side}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    marks = ("handwritten_ddp.py",) if side.startswith("hand") else ("spawn_main",)
    with hog(busy):
        done, tree, total_cpu = run_sampled(_command(side, w, work, out, smoke), marks,
                                            cwd=REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{side} (DDP) failed ({done.returncode}):\n{done.stderr[-3000:]}")
    first, last = ((out / f"checkpoint-{e}.tar").stat().st_mtime for e in (1, w.epochs))
    epochs = w.epochs - 1
    roles = tree.between(first, last)
    per_epoch = {role: {k: v / epochs if k in COUNTERS else v
                        for k, v in roles.get(role, {}).items()} for role in ROLES}
    return {"wall": (last - first) / epochs, "roles": per_epoch, "total_cpu": total_cpu,
            "loss": _final_loss(side, out)}


def measure_ddp(w: Workload, runs: int, smoke: bool, busy: bool, work: Path) -> dict:
    """A/B-alternated runs of every side; the medians, and the ratios of echelon3's to the
    hand-written loop's (``ratio_like``: to the one with the same DDP)."""
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for k in range(runs):
        for side in list(SIDES)[::1 if k % 2 == 0 else -1]:
            results[side].append(run_ddp_side(side, w, work, smoke, busy))
    row = {"row": w.name + (", CPU hog on every core" if busy else ", quiet"), "busy": busy}
    for side, rs in results.items():
        row[side] = {
            "wall": (min(r["wall"] for r in rs), statistics.median(r["wall"] for r in rs)),
            "total_cpu": statistics.median(r["total_cpu"] for r in rs),
            "loss": rs[-1]["loss"],
            "roles": {role: {key: statistics.median(r["roles"][role].get(key, 0) for r in rs)
                             for key in (*COUNTERS, "processes", "threads", "sessions",
                                         "in_launcher_session")}
                      for role in ROLES}}
    for side in ("echelon3", "echelon3_nofu", "hand_fu"):
        ours, hand, like = row[side], row["hand"], row[LIKE.get(side, "hand")]
        ours["ratio_wall"] = (ours["wall"][0] / hand["wall"][0],
                              ours["wall"][1] / hand["wall"][1])
        ours["ratio_like"] = ours["wall"][0] / like["wall"][0]
        ours["ratio_cpu"] = _cpu(ours) / _cpu(like) if _cpu(like) > 0 else float("nan")
        ours["same_loss"] = abs(hand["loss"] - ours["loss"]) <= 1e-4 * max(1.0, abs(hand["loss"]))
    row["same_loss"] = all(row[side]["same_loss"] for side in (*LIKE, "hand_fu"))
    row["ratio_wall"], row["ratio_cpu"] = row["echelon3"]["ratio_wall"], row["echelon3"]["ratio_cpu"]
    row["ratio_like"] = row["echelon3"]["ratio_like"]
    return row


def _cpu(side: dict) -> float:
    return sum(side["roles"][r]["cpu"] for r in ROLES)


def ddp_table(rows: list[dict], runs: int) -> str:
    """The ratios against the hand-written loop, then where the CPU went, per side and role."""
    lines = ["| DDP row | side | s/epoch: wall min / median | ratio wall min "
             "| ratio wall median | **ratio wall min, like for like** "
             "| ratio CPU, like for like (all processes, steady) | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for side, name in SIDES.items():
            x = r[side]
            like = f" (vs {SIDES[LIKE[side]]})" if side in LIKE else ""
            ratios = "| 1 | 1 | - | -" if side == "hand" else (
                f"| {x['ratio_wall'][0]:.3f} | {x['ratio_wall'][1]:.3f} "
                + (f"| **{x['ratio_like']:.3f}**{like} | {x['ratio_cpu']:.3f}"
                   if side in LIKE else "| - | -"))
            same = "" if side == "hand" else (" (same)" if x["same_loss"] else " (DIFFERS)")
            lines.append(f"| {r['row']} | {name} | {x['wall'][0]:.3f} / {x['wall'][1]:.3f} "
                         f"{ratios} | {x['loss']:.6f}{same} |")
    lines += ["", "Where the CPU went, per steady epoch (medians): CPU s, s runnable but "
              "waiting for a core, context switches (voluntary / involuntary), processes x "
              "most threads in one; the whole run's CPU s from the kernel (start-up "
              "included).", "",
              "| DDP row | side | launcher | ranks | other | whole run CPU s |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        for side, name in SIDES.items():
            cells = []
            for role in ROLES:
                x = r[side]["roles"][role]
                cells.append(f"{x['cpu']:.3f} s, {x['run_delay']:.3f} s waiting, "
                             f"{x['voluntary']:.0f} / {x['involuntary']:.0f}, "
                             f"{x['processes']:.0f} x {x['threads']:.0f}" if x["processes"]
                             else "-")
            lines.append(f"| {r['row']} | {name} | {' | '.join(cells)} "
                         f"| {r[side]['total_cpu']:.2f} |")
    lines.append(f"\n{runs} A/B-alternated runs per side; --hog: one bounded busy loop per "
                 "core beside each run; OMP_NUM_THREADS left to each launcher.")
    lines.append("\n" + contention_paragraph(rows))
    return "\n".join(lines)


def _autogroup() -> str:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "unknown"


def contention_paragraph(rows: list[dict]) -> str:
    """What echelon3 added under contention, in the figures just measured."""
    parts, helpers_small, waiting = [], True, []
    for r in rows:
        hand, ours, hand_fu, nofu = (r[s]["roles"] for s in SIDES)
        wall, cpu = r["echelon3_nofu"]["ratio_wall"][0], r["echelon3_nofu"]["ratio_cpu"]
        if wall > 1.1 * cpu:  # the same work, more time: waiting, not computing
            waiting.append(f"{'beside the hog' if r['busy'] else 'quiet'} {cpu:.2f}x the CPU "
                           f"and {wall:.2f}x the wall time (runnable but waiting for a core: "
                           f"{nofu['worker']['run_delay']:.3f} s per epoch, hand-written "
                           f"{hand['worker']['run_delay']:.3f} s)")
        search = ours["worker"]["cpu"] - nofu["worker"]["cpu"]
        hand_search = hand_fu["worker"]["cpu"] - hand["worker"]["cpu"]
        launcher = ours["launcher"]["cpu"] + ours["other"]["cpu"]
        helpers_small = helpers_small and launcher < 0.05 * max(1e-9, ours["worker"]["cpu"])
        parts.append(
            f"{'Beside the hog' if r['busy'] else 'Quiet'}: the ranks took "
            f"{ours['worker']['cpu']:.3f} CPU s per epoch under echelon3's defaults, "
            f"{nofu['worker']['cpu']:.3f} s with ddp_find_unused_parameters: false and "
            f"{hand['worker']['cpu']:.3f} s hand-written; the unused-parameter search cost "
            f"{search:+.3f} s per epoch under echelon3 and {hand_search:+.3f} s hand-written "
            f"(DDP's own search: {r['echelon3']['ratio_like']:.3f}x the wall time of the "
            f"hand-written loop with it), echelon3's launcher and helpers {launcher:.3f} s "
            f"(torchrun's agent {hand['launcher']['cpu']:.3f} s)")
    ranks = rows[-1]["echelon3_nofu"]["roles"]["worker"]
    hand_ranks = rows[-1]["hand"]["roles"]["worker"]
    sessions = (
        f" Sessions: echelon3's {ranks['processes']:.0f} ranks ran in {ranks['sessions']:.0f} "
        f"session(s), {ranks['in_launcher_session']:.0f} of them in the launcher's; "
        f"torchrun's {hand_ranks['processes']:.0f} in {hand_ranks['sessions']:.0f}, "
        f"{hand_ranks['in_launcher_session']:.0f} in its agent's. Under the kernel's "
        f"autogroup scheduling (kernel.sched_autogroup_enabled = {_autogroup()} here) the CPU is shared between sessions first: a rank left in the "
        "launching session (the hog's here) shares that session's part, which is what "
        "echelon3 added under contention until each rank led a session of its own, as "
        "torchrun's do.")
    waits = ("" if not waiting else
             " With ddp_find_unused_parameters: false echelon3's ranks took "
             + " and ".join(waiting) + " of the hand-written loop's: that part of the time "
             "the ranks were not computing but waiting: for a core (the figure in brackets, "
             "over both ranks), else asleep, for each other at an all-reduce.")
    return ("**What echelon3 added under contention.** " + ". ".join(parts) +
            (". The launcher's polling and threads take under 5% of the ranks' CPU: the "
             "ranks' per-step work is where the CPU goes." if helpers_small else
             ". The launcher and its helpers take 5% or more of the ranks' CPU.") + waits
            + sessions)

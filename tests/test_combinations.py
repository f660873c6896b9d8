"""Where the trainer's features meet: precision x grad_accum_steps x nan_policy (with a
planted NaN) x interruption x loader workers x ranks x recipe (``full``: warmup then
cosine stepped per optimizer step, gradient clipping, EMA weights, early stopping) x length
(``steps``: ``max_steps`` ending inside an epoch, validation every N steps, a step
checkpoint after every step) x data (``stream``: an IterableDataset through torchdata's
StatefulDataLoader, whose sample ids the resumed attempt must read on exactly). Each combination, interrupted and
resumed, must end exactly as the uninterrupted run: the same exit code, the same epoch
checkpoints, their weights, optimizer state and GradScaler state bit for bit, and the same
history. (Nothing here changes a reduction order: a mid-window checkpoint carries each
rank's own gradients, the running losses carry their per-step values.)

The default run covers the matrix pairwise (every pair of values of any two factors
appears); ``pytest -m slow tests/test_combinations.py`` (or tools/run_slow_tests.sh) runs
the whole product. Refused at start, with one line: nothing in this matrix (a closure
optimizer with grad_accum_steps > 1 or nan_policy skip is, see tests/test_accumulation.py
and tests/test_trainer_meets.py).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from echelon3.distributed import preemption
from tests.conftest import run_cli
from tests.helpers import echelon3, load, same_nested, without_clock, write_config

EPOCHS = 2
STEPS = 6  # micro-batches per epoch: 48 samples, global batch 8
SIGNAL_AT = STEPS + 2  # epoch 2, micro-batch 2: inside a window of 3
STEPS_RUN = 2 * STEPS + 3  # micro-batches of a run counted in steps (length: steps)
NAN_AT = {"skip": 4, "stop": STEPS + 4}  # stop: after the interruption, so both happen
RESUBMIT, KILLED = 75, (-9, 1)  # one process dies of SIGKILL; the launcher reports 1


LR = "torch.optim.lr_scheduler"
FULL_RECIPE = {
    "scheduler": {"module": LR, "type": "SequentialLR", "interval": "step", "config": {
        "milestones": [2], "schedulers": [
            {"module": LR, "type": "LinearLR", "config": {"start_factor": 0.2, "total_iters": 2}},
            {"module": LR, "type": "CosineAnnealingLR", "config": {"T_max": "total_steps - 2"}}]}},
    "trainer": {"config": {"gradient_clip_val": 0.5,
                           "ema": {"decay": 0.9, "every_n_steps": 1, "warmup_steps": 2},
                           "early_stopping": {"patience": 3}}},
}


def config(folder: Path, precision: str, accum: int, nan: str, workers: int,
           persistent: bool, recipe: str = "plain", length: str = "epochs",
           data: str = "map") -> None:
    loader = {"batch_size": 8, "drop_last": True, "num_workers": workers,
              **({"shuffle": True} if data == "map" else {})}
    if workers:
        loader["persistent_workers"] = persistent
    updates = {
        "net": {"module": "tests.combo", "type": "ComboNet", "config": {"hidden": 16}},
        "data": {"train": {"module": "tests.combo",
                           "type": "NoisyBlobs" if data == "map" else "StreamBlobs",
                           "config": {"size": 48}},
                 "test": {"module": "tests.combo", "type": "NoisyBlobs",
                          "config": {"size": 24, "seed": 1}}},
        "dataloaders": {"train": {"config": loader}},
        "metrics": [{"accuracy": {"module": "torchmetrics.classification",
                                  "type": "MulticlassAccuracy",
                                  "config": {"num_classes": 3, "average": "micro"}}}],
        "optimizer": {"config": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}},
        "trainer": {"config": {"epochs": EPOCHS, "precision": precision,
                               "grad_accum_steps": accum, "nan_policy": nan,
                               "log_every_n_steps": 2}},
    }
    if length == "steps":  # ends inside epoch 3; a step checkpoint after every step
        updates["trainer"]["config"].update(epochs=None, max_steps=STEPS_RUN // accum,
                                            val_check_interval=max(2, 5 // accum))
        updates["target"] = {"every_n_steps": 1}
    if recipe == "full":
        updates = OmegaConf.to_container(OmegaConf.merge(updates, FULL_RECIPE))
    remove = ("net", "data", *(("scheduler",) if recipe == "full" else ()),
              *(("dataloaders.train.config.shuffle",) if data == "stream" else ()))
    write_config(folder, updates, remove=remove)


def train(folder: Path, ranks: int, env: dict) -> int:
    """One attempt: in this process where it can be (one rank, no SIGKILL), else the CLI."""
    if ranks == 1 and env.get("COMBO_SIGNAL") != "KILL":
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        preemption.reset()
        try:
            return echelon3("train", folder)
        finally:
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    args = ["train", "-cd", str(folder), "-cn", "run", *(["nproc=2"] if ranks > 1 else [])]
    result = run_cli(args, env=env, timeout=240)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.returncode


def outcome(out: Path, steps: bool = False) -> dict:
    """The run's checkpoints (``steps``: its step checkpoints too; else a preemption's,
    which a run stopped by a NaN after it leaves behind, are not compared)."""
    names = sorted(p.name for p in out.glob("checkpoint-*.tar") if steps or "-step" not in p.name)
    states = {name: load(out / name) for name in names}
    records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return {
        "checkpoints": names,
        "weights": {n: s["model_state_dict"] for n, s in states.items()},
        "training weights": {n: s.get("training_model_state_dict") for n, s in states.items()},
        "scheduler": {n: s["scheduler_state_dict"] for n, s in states.items()},
        "optimizer": {n: s["optimizer_state_dict"] for n, s in states.items()},
        "scaler": {n: s["scaler_state_dict"] for n, s in states.items()},
        "steps": {n: s["global_step"] for n, s in states.items()},
        "history": without_clock(records),
    }


def ids_seen(prefix: Path, ranks: int) -> list[list[int]]:
    """Each rank's training sample ids, in order (and the files emptied)."""
    out = []
    for rank in range(ranks):
        path = Path(f"{prefix}.{rank}")
        out.append([int(n) for n in path.read_text().split()] if path.exists() else [])
        path.unlink(missing_ok=True)
    return out


def run_combination(tmp: Path, precision, accum, nan, interrupt, workers, ranks,
                    recipe, length="epochs", data="map") -> None:
    persistent = accum == 3 and data == "map"  # persistent workers in some worker runs
    ids = tmp / "ids"
    env = {"COMBO_NAN_AT": str(NAN_AT[nan]), "COMBO_SIGNAL_AT": "0", "COMBO_IDS": str(ids)}
    straight, cut = tmp / "straight", tmp / "cut"
    for folder in (straight, cut):
        config(folder, precision, accum, nan, workers, persistent, recipe, length, data)
    expected = 2 if nan == "stop" else 0  # the planted NaN stops the run, or is skipped
    assert train(straight, ranks, env) == expected
    assert (straight / "out" / "checkpoint-1.tar").exists()  # the NaN comes in epoch 2
    straight_ids = ids_seen(ids, ranks)
    signal_env = {**env, "COMBO_SIGNAL_AT": str(SIGNAL_AT), "COMBO_SIGNAL": interrupt.upper(),
                  "COMBO_MARKER": str(tmp / "signalled")}
    first = train(cut, ranks, signal_env)
    first_ids = ids_seen(ids, ranks)
    assert (tmp / "signalled").exists()
    if interrupt == "usr1":
        assert first == RESUBMIT
        assert list((cut / "out").glob("checkpoint-1-step*.tar"))
    else:
        assert first in KILLED
    assert train(cut, ranks, signal_env) == expected
    if data == "stream":  # the resumed attempt reads on exactly where the checkpoint stood
        for whole, before, after in zip(straight_ids, first_ids, ids_seen(ids, ranks)):
            done = len(whole) - len(after)
            assert after and before[:done] == whole[:done] and after == whole[done:]
    a, b = (outcome(run / "out", length == "steps") for run in (straight, cut))
    assert a["checkpoints"] == b["checkpoints"]
    assert [n for n in a["checkpoints"] if "-step" not in n] == [
        f"checkpoint-{e}.tar" for e in range(1, EPOCHS + (expected == 0))]
    for key in ("steps", "weights", "training weights", "optimizer", "scaler", "scheduler"):
        assert same_nested(a[key], b[key]), key
    assert a["history"] == b["history"]
    train_steps = [r["step"] for r in a["history"] if r["split"] == "train"]
    assert train_steps == sorted(set(train_steps))  # one record per step, increasing


FACTORS = {"precision": ("fp32", "bf16", "fp16"), "accum": (1, 3), "nan": ("stop", "skip"),
           "interrupt": ("usr1", "kill"), "workers": (0, 2), "ranks": (1, 2),
           "recipe": ("plain", "full"), "length": ("epochs", "steps"),
           "data": ("map", "stream")}
# Every pair of values of any two factors appears in one of these rows.
PAIRWISE = [
    ("fp32", 1, "stop", "usr1", 0, 1, "plain", "steps", "stream"),
    ("fp32", 3, "skip", "kill", 2, 2, "full", "epochs", "map"),
    ("bf16", 1, "skip", "kill", 0, 2, "plain", "epochs", "map"),
    ("bf16", 3, "stop", "usr1", 2, 1, "full", "steps", "stream"),
    ("fp16", 1, "stop", "kill", 2, 2, "full", "epochs", "stream"),
    ("fp16", 3, "skip", "kill", 0, 1, "full", "steps", "map"),
    ("fp16", 3, "skip", "usr1", 2, 2, "plain", "steps", "stream"),
    ("fp32", 1, "stop", "usr1", 0, 1, "plain", "epochs", "map"),
]
# Beyond the pairs: a SIGKILL at 2 ranks of a run with a step checkpoint after every step.
EXTRA = [("fp32", 1, "skip", "kill", 0, 2, "plain", "steps", "map")]
FULL = [row for row in itertools.product(*FACTORS.values()) if row not in PAIRWISE + EXTRA]


def test_the_pairwise_rows_cover_every_pair():
    names = list(FACTORS)
    for i, j in itertools.combinations(range(len(names)), 2):
        needed = set(itertools.product(FACTORS[names[i]], FACTORS[names[j]]))
        assert needed <= {(row[i], row[j]) for row in PAIRWISE}, (names[i], names[j])


@pytest.mark.parametrize("row", PAIRWISE + EXTRA, ids=lambda r: "-".join(map(str, r)))
def test_interrupted_and_resumed_equals_the_straight_run(tmp_path, row, own_handlers):
    run_combination(tmp_path, *row)


@pytest.mark.slow
@pytest.mark.parametrize("row", FULL, ids=lambda r: "-".join(map(str, r)))
def test_every_combination(tmp_path, row, own_handlers):
    run_combination(tmp_path, *row)

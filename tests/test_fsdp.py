"""strategy: fsdp for real: 2 and 3 gloo ranks on the CPU through the built-in launcher.

One process, 2-rank DDP and 2-rank FSDP train the same model (a Linear shard unit under
activation checkpointing, AdamW) to the same weights within 1e-5 (fp32: the ranks'
sums round differently); a sharded checkpoint resumes at another world size; a
preemption and a kill mid-epoch resume to the uninterrupted run's weights bit for bit.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

from echelon3.checkpoints.files import CheckpointManager
from echelon3.distributed import preemption
from tests.conftest import edit_yaml, probe_config, run_cli
from tests.helpers import without_clock
from tests.test_dist import _alive, _wait_for
from tests.test_preemption import _interrupted_run

EPOCHS, STEPS = 3, 6  # 144 samples, global batch 24: divisible by 1, 2 and 3 ranks
TOLERANCE = 1e-5
TIMEOUT = 240


def _config(directory: Path, strategy: str = "fsdp", net: dict | None = None) -> None:
    # validation: 97 samples in global batches of 6, so 2 ranks run 17 and 16 batches
    probe_config(directory, train_size=144, test_size=97, batch=24, epochs=EPOCHS,
                 net={"sleep": 0.05, **(net or {})},
                 extra={"strategy": strategy, "fsdp": {"units": ["Linear"]},
                        "activation_checkpointing": ["Linear"],
                        "optimizer": {"module": "torch.optim", "type": "AdamW",
                                      "config": {"lr": 0.05}},
                        # EMA on: its average is kept sharded, consolidated and resumed
                        "trainer": {"config": {"epochs": EPOCHS, "precision": "fp32",
                                               "log_every_n_steps": 1, "progress_bar": False,
                                               "ema": {"decay": 0.8, "warmup_steps": 2}}}})
    edit_yaml(directory / "probe.yaml",
              lambda cfg: cfg["dataloaders"]["test"]["config"].update(batch_size=6))


def _train(directory: Path, world: int, *overrides: str):
    args = ["train", "-cd", str(directory), "-cn", "probe", *overrides]
    result = run_cli([*args, f"nproc={world}"] if world > 1 else args, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    return result


def sharded_state(folder: Path, tmp: Path) -> dict:
    """A sharded checkpoint folder read whole, with torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


TRAINING = "training:"  # _weights' prefix of the training weights beside EMA's average


def _weights(directory: Path, epoch: int = EPOCHS) -> dict:
    """The average (``model_state_dict``) and the training weights, prefixed, of a run."""
    run = directory / "run"
    if (run / f"checkpoint-{epoch}.tar").exists():
        state = torch.load(run / f"checkpoint-{epoch}.tar", weights_only=True)
    else:
        state = sharded_state(run / f"checkpoint-{epoch}.dcp", directory)
    return {**state["model_state_dict"],
            **{TRAINING + k: v for k, v in state["training_model_state_dict"].items()}}


# --------------------------------------------------------------------------- settings, refusals

def _settings(**trainer):
    from echelon3.distributed.ddp import DDP_KEYS

    return {"precision": "fp32", "compile": False, **DDP_KEYS, **trainer}


@pytest.mark.parametrize("cfg,trainer,key", [
    ({"strategy": "zero3"}, {}, "strategy"),
    ({"strategy": "fsdp", "fsdp": {"unit": ["Block"]}}, {}, "fsdp.unit"),
    ({"strategy": "fsdp", "fsdp": {"units": "Block"}}, {}, "fsdp.units"),
    ({"strategy": "fsdp", "fsdp": {"units": ["(Block"]}}, {}, "fsdp.units"),
    ({"strategy": "fsdp", "fsdp": {"offload": "yes"}}, {}, "fsdp.offload"),
    ({"strategy": "fsdp", "fsdp": {"offload": True}}, {}, "fsdp.offload"),
    ({"strategy": "fsdp"}, {"precision": "fp16"}, "trainer.config.precision"),
    ({"strategy": "fsdp"}, {"ddp_comm": "fp16"}, "trainer.config.ddp_comm"),
])
def test_refusals_name_the_key(cfg, trainer, key):
    from echelon3.config.errors import ConfigError
    from echelon3.distributed.fsdp import Strategy

    with pytest.raises(ConfigError) as caught:
        Strategy(cfg, _settings(**trainer), torch.device("cpu"))
    assert caught.value.key == key and "\n" not in str(caught.value)


def test_units_and_checkpointing_match_class_names_and_regexes():
    from echelon3.config.errors import ConfigError
    from echelon3.distributed.fsdp import Strategy
    from echelon3.nets.transformer import RowTransformer, TransformerBlock

    net = RowTransformer(dim=8, heads=2, depth=3)
    names = dict(net.named_parameters())
    cfg = {"strategy": "fsdp", "fsdp": {"units": ["Transformer.*"]},
           "activation_checkpointing": ["TransformerBlock"]}
    params = Strategy(cfg, _settings(), torch.device("cpu")).prepare(
        net, list(names.values()), torch.device("cpu"), 1, _settings())
    assert params == list(names.values())  # one process: nothing sharded, names kept
    assert dict(net.named_parameters()).keys() == names.keys()
    calls = []
    for block in (m for m in net.modules() if isinstance(m, TransformerBlock)):
        block.mlp[0].register_forward_pre_hook(lambda *_: calls.append(1))
    out = net(torch.randn(4, 64))
    assert len(calls) == 3
    out.sum().backward()  # each block's activations were not kept: computed again here
    assert len(calls) == 6
    assert all(p.grad is not None for p in net.parameters())
    with pytest.raises(ConfigError, match="'Blok' matches no module .*TransformerBlock"):
        Strategy({**cfg, "fsdp": {"units": ["Blok"]}}, _settings(), "cpu").prepare(
            RowTransformer(dim=8, heads=2), [], torch.device("cpu"), 1, _settings())


# --------------------------------------------------------------------------- runs

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> folder of an uninterrupted run: one process, DDP and FSDP at 2 ranks."""
    out = {}
    for name, strategy, world in (("one", "fsdp", 1), ("ddp", "ddp", 2), ("fsdp", "fsdp", 2)):
        out[name] = tmp_path_factory.mktemp(name)
        _config(out[name], strategy)
        _train(out[name], world)
    return out


def test_one_process_ddp_and_fsdp_train_to_the_same_weights(runs):
    one, ddp, fsdp = (_weights(runs[n]) for n in ("one", "ddp", "fsdp"))
    assert one.keys() == ddp.keys() == fsdp.keys() == {
        "fc.weight", "fc.bias", TRAINING + "fc.weight", TRAINING + "fc.bias"}
    assert not torch.equal(one["fc.weight"], one[TRAINING + "fc.weight"])  # an average
    assert not torch.equal(one["fc.weight"], _weights(runs["one"], 1)["fc.weight"])  # it moved
    for key in one:
        torch.testing.assert_close(ddp[key], one[key], rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(fsdp[key], one[key], rtol=0, atol=TOLERANCE)


def test_sharded_checkpoint_layout_and_a_consolidated_best(runs):
    run = runs["fsdp"] / "run"
    folder = run / f"checkpoint-{EPOCHS}.dcp"
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp",
                                                        "__1_0.distcp", "state.pt"]
    best = torch.load(run / "best.tar", weights_only=True)
    assert best["optimizer_state_dict"] is None and best["epoch"] >= 1
    # rank 0's file holds the whole network, plain tensors under the network's own names
    saved = {k: v for k, v in _weights(runs["fsdp"], best["epoch"]).items()
             if not k.startswith(TRAINING)}  # EMA's average: what best.tar holds
    assert best["model_state_dict"].keys() == saved.keys()
    for key, value in saved.items():
        assert type(best["model_state_dict"][key]) is torch.Tensor
        assert torch.equal(best["model_state_dict"][key], value)
    optim = sharded_state(folder, runs["fsdp"])["optimizer_state_dict"]
    assert set(optim["state"]) == {"fc.weight", "fc.bias"}  # AdamW's moments, by name
    assert float(optim["state"]["fc.weight"]["step"]) == EPOCHS * STEPS
    # validation ran through the lockstep shards (17 and 16 batches), every sample once
    val = [r for r in _history(runs["fsdp"]) if r["split"] == "val"]
    ref = [r for r in _history(runs["one"]) if r["split"] == "val"]
    assert [r["seen"] for r in val] == [97.0] * EPOCHS
    for mine, theirs in zip(val, ref):
        assert mine["accuracy"] == pytest.approx(theirs["accuracy"], abs=1e-6)


def _history(directory: Path) -> list[dict]:
    import json

    lines = (directory / "run" / "history.jsonl").read_text().splitlines()
    return without_clock(list(map(json.loads, lines)))


def test_a_checkpoint_written_at_2_ranks_resumes_at_1_then_3(runs, tmp_path):
    _config(tmp_path)
    shutil.copytree(runs["fsdp"] / "run", tmp_path / "run")  # its first epoch, at 2 ranks
    for later in (tmp_path / "run").glob("checkpoint-[23].dcp"):
        shutil.rmtree(later)
    # (its fingerprint holds the other folder's probe log: on_config_change=resume)
    second = _train(tmp_path, 1, "trainer.config.epochs=2", "on_config_change=resume")
    assert "run/checkpoint-1.dcp was made by a different config; resuming" in second.stderr
    third = _train(tmp_path, 3, "trainer.config.epochs=3", "on_config_change=resume")
    assert "run/checkpoint-2.dcp (epoch 2, step 12)" in third.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint-3.dcp").glob("*.distcp")) \
        == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    mine, ref = _weights(tmp_path), _weights(runs["fsdp"])
    for key in ref:
        torch.testing.assert_close(mine[key], ref[key], rtol=0, atol=TOLERANCE)


def test_preempted_two_rank_fsdp_resumes_to_the_same_weights(runs, tmp_path):
    _config(tmp_path, net={"sleep": 0.3})
    code, err, _, pids = _interrupted_run(tmp_path, 2, signal.SIGTERM, True)
    assert code == preemption.RESUBMIT_EXIT, err
    assert _wait_for(lambda: not _alive(pids), 10), f"left running: {_alive(pids)}"
    rolling = CheckpointManager(tmp_path / "run").rolling()  # .tar files only
    folders = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-1-step*.dcp"))
    assert len(folders) == 1 and not any("-step" in p.name for p in rolling), err
    step = int(folders[0].split("step")[1].split(".")[0])
    assert STEPS < step < 2 * STEPS, step  # part-way through epoch 2
    _train(tmp_path, 2)
    assert not list((tmp_path / "run").glob("checkpoint-*-step*"))  # superseded
    mine, ref = _weights(tmp_path), _weights(runs["fsdp"])
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    assert _history(tmp_path) == _history(runs["fsdp"])


def test_killed_two_rank_fsdp_resumes_from_its_last_complete_checkpoint(runs, tmp_path):
    _config(tmp_path, net={"fail_on_rank": 1, "fail_at_step": STEPS + 2, "kill": True})
    result = run_cli(["train", "-cd", str(tmp_path), "-cn", "probe", "nproc=2"],
                     timeout=TIMEOUT)
    assert result.returncode != 0
    run = tmp_path / "run"
    assert [p.name for p in run.glob("checkpoint-*")] == ["checkpoint-1.dcp"]
    torn = run / ".checkpoint-2.dcp.tmp"  # as a save killed half-way leaves it
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"torn")
    second = _train(tmp_path, 2, "net.config.fail_on_rank=null", "on_config_change=resume")
    assert "run/checkpoint-1.dcp was made by a different config; resuming" in second.stderr
    assert not torn.exists()
    mine, ref = _weights(tmp_path), _weights(runs["fsdp"])
    assert all(torch.equal(mine[k], ref[k]) for k in ref)


def test_killed_two_rank_fsdp_resumes_from_its_step_checkpoint(runs, tmp_path):
    """SIGKILL with step checkpoints (target.every_n_steps: 1): at most one step is lost."""
    _config(tmp_path, net={"fail_on_rank": 1, "fail_at_step": STEPS + 2, "kill": True})
    result = run_cli(["train", "-cd", str(tmp_path), "-cn", "probe", "nproc=2",
                      "+target.every_n_steps=1"], timeout=TIMEOUT)
    assert result.returncode != 0
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == [
        "checkpoint-1-step7.dcp", "checkpoint-1.dcp"]
    second = _train(tmp_path, 2, "net.config.fail_on_rank=null", "on_config_change=resume",
                    "+target.every_n_steps=1")
    assert "checkpoint-1-step7.dcp was made by a different config; resuming" in second.stderr
    mine, ref = _weights(tmp_path), _weights(runs["fsdp"])
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    assert _history(tmp_path) == _history(runs["fsdp"])


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_a_run_continues_under_the_other_strategy(runs, tmp_path, first, then):
    """The strategy is not part of the run's identity: epoch 1 under one, 2-3 under the other."""
    _config(tmp_path, first)
    _train(tmp_path, 2, "trainer.config.epochs=1")
    _config(tmp_path, then)
    _train(tmp_path, 2)
    mine, ref = _weights(tmp_path), _weights(runs["ddp"])
    for key in ref:
        torch.testing.assert_close(mine[key], ref[key], rtol=0, atol=TOLERANCE)


@pytest.mark.slow
def test_accumulation_under_fsdp_equals_ddp(tmp_path):
    """grad_accum_steps=3: FSDP skips the reduce-scatter inside a window, DDP the all-reduce."""
    weights = {}
    for strategy in ("ddp", "fsdp"):
        _config(tmp_path / strategy, strategy)
        _train(tmp_path / strategy, 2, "trainer.config.grad_accum_steps=3",
               "trainer.config.epochs=1")
        weights[strategy] = _weights(tmp_path / strategy, 1)
    for key in weights["ddp"]:
        torch.testing.assert_close(weights["fsdp"][key], weights["ddp"][key], rtol=0,
                                   atol=TOLERANCE)

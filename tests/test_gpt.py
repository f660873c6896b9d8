"""The GPT net, the sequence loss, the token metrics, and one GPT trained through the CLI on
its own loss with weight-decay rules."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from echelon3.losses.sequence import SequenceCrossEntropy
from echelon3.metrics.tokens import Perplexity, TokenAccuracy
from echelon3.nets.gpt import GPT
from tests.helpers import echelon3, history, load, target, write_config
from tests.token_data import Tokens

SIZES = {"vocab_size": 16, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(**SIZES).eval()


def test_its_loss_is_the_cross_entropy_of_its_logits_over_counted_tokens(gpt):
    x, y = (torch.stack(t) for t in zip(*(Tokens()[i] for i in range(4))))
    assert (y == -100).any()
    logits, loss = gpt(x, y)
    assert torch.equal(logits, gpt(x))
    counted = y != -100
    by_hand = -torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    assert torch.allclose(loss, by_hand[counted].mean(), atol=1e-6)
    assert gpt.head.weight is gpt.tok.weight  # tied


def test_a_token_changes_no_logit_before_it(gpt):
    x = torch.randint(16, (2, 8), generator=torch.Generator().manual_seed(1))
    for t in (0, 3, 7):
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 5) % 16
        a, b = gpt(x), gpt(changed)
        assert torch.equal(a[:, :t], b[:, :t])
        assert not torch.allclose(a[:, t], b[:, t])


def test_generate_is_seeded_and_greedy_at_temperature_zero(gpt):
    start = torch.tensor([[1, 2, 3]])

    def draw(seed, **kw):
        return gpt.generate(start, 10, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(draw(5), draw(5)) and draw(5).shape == (1, 13)
    assert torch.equal(draw(5, top_k=3), draw(5, top_k=3))
    idx = start
    for _ in range(10):  # greedy by hand, the context cut to block_size
        idx = torch.cat([idx, gpt(idx[:, -8:])[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gpt.generate(start, 10, temperature=0), idx)
    top1 = draw(7, top_k=1)  # one candidate: the greedy choice whatever the seed
    assert torch.equal(top1, idx)


def _logits_and_targets(seed: int, batch: int, ignored: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, 5, 7, generator=g)
    y = torch.randint(7, (batch, 5), generator=g)
    y.view(-1)[torch.randperm(batch * 5, generator=g)[:ignored]] = -100
    y.view(-1)[0] = logits.view(-1, 7)[0].argmax()  # at least one right
    return logits, y


def _by_hand(logits, y):
    """(accuracy, perplexity) by a loop over the counted tokens."""
    right, nll, counted = 0, 0.0, 0
    for b in range(y.shape[0]):
        for t in range(y.shape[1]):
            if y[b, t] == -100:
                continue
            counted += 1
            right += int(logits[b, t].argmax() == y[b, t])
            nll -= float(torch.log_softmax(logits[b, t].double(), -1)[y[b, t]])
    return right / counted, math.exp(nll / counted)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sequence_cross_entropy_is_the_flat_cross_entropy(smoothing):
    logits, y = _logits_and_targets(0, 3, 4)
    loss = SequenceCrossEntropy(label_smoothing=smoothing)(logits, y)
    flat = F.cross_entropy(logits.reshape(-1, 7), y.reshape(-1), ignore_index=-100,
                           label_smoothing=smoothing)
    assert torch.equal(loss, flat)
    if smoothing == 0:
        assert math.exp(loss) == pytest.approx(_by_hand(logits, y)[1], rel=1e-5)
    with pytest.raises(ValueError, match="plus a vocabulary dimension"):
        SequenceCrossEntropy()(logits, y[:, :4])


def test_token_metrics_count_tokens_not_sequences():
    accuracy, perplexity = TokenAccuracy(), Perplexity()
    parts = [_logits_and_targets(1, 2, 3), _logits_and_targets(2, 3, 9)]
    for logits, y in parts:
        accuracy.update(logits, y)
        perplexity.update(logits, y)
    logits, y = (torch.cat(t) for t in zip(*parts))
    hand_accuracy, hand_perplexity = _by_hand(logits, y)
    assert accuracy.compute().item() == pytest.approx(hand_accuracy, abs=1e-12)
    assert perplexity.compute().item() == pytest.approx(hand_perplexity, rel=1e-5)


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        logits, y = _logits_and_targets(1 + rank, 2 + rank, 3 + 6 * rank)  # unequal counts
        accuracy, perplexity = TokenAccuracy(), Perplexity()
        accuracy.update(logits, y)
        perplexity.update(logits, y)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"accuracy": accuracy.compute().item(),
                       "perplexity": perplexity.compute().item(),
                       "counted": int((y != -100).sum())}, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_reduce_to_the_union_of_their_tokens(tmp_path):
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["counted"] != results[1]["counted"]
    parts = [_logits_and_targets(1 + r, 2 + r, 3 + 6 * r) for r in (0, 1)]
    logits, y = (torch.cat(t) for t in zip(*parts))
    single = TokenAccuracy(), Perplexity()
    for metric in single:
        metric.update(logits, y)
    for result in results:
        assert result["accuracy"] == pytest.approx(single[0].compute().item(), abs=1e-12)
        assert result["perplexity"] == pytest.approx(single[1].compute().item(), rel=1e-6)
        assert result["accuracy"] == pytest.approx(_by_hand(logits, y)[0], abs=1e-12)


# --------------------------------------------------------------------------- through the CLI

NO_DECAY = {"ndim_below": 2, "modules": ["LayerNorm", "Embedding"], "names": ["*.bias"]}
TOKENS = "tests.token_data"


def _gpt_config(folder):
    loader = {"module": "torch.utils.data", "type": "DataLoader"}
    write_config(folder, {
        "net": {"module": "echelon3.nets.gpt", "type": "GPT", "config": SIZES},
        "data": {"train": {"module": TOKENS, "type": "Tokens", "config": {"size": 64}},
                 "test": {"module": TOKENS, "type": "Tokens", "config": {"size": 32, "seed": 1}}},
        "dataloaders": {"train": {**loader, "config": {"batch_size": 8, "shuffle": False}},
                        "test": {**loader, "config": {"batch_size": 16}}},
        "loss": "from_output",
        "metrics": [{"token_accuracy": {"module": "echelon3.metrics.tokens",
                                        "type": "TokenAccuracy"}},
                    {"perplexity": {"module": "echelon3.metrics.tokens", "type": "Perplexity"}}],
        "optimizer": {"module": "torch.optim", "type": "AdamW",
                      "config": {"lr": 0.01, "weight_decay": 0.1}, "no_decay": NO_DECAY},
        "trainer": {"config": {"epochs": 1, "keep_best_on": "token_accuracy",
                               "log_every_n_steps": 1}},
    }, remove=("loss", "metrics", "scheduler", "dataloaders", "data", "net", "optimizer"))


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt")
    _gpt_config(folder)
    logs = logging.getLogger("echelon3.tasks.components")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logs.addHandler(handler)
    try:
        assert echelon3("train", folder) == 0
    finally:
        logs.removeHandler(handler)
    return folder, records


def _initial_gpt():
    from echelon3.data.rng import seed_everything

    seed_everything(0)  # the run's seed, before it builds the net
    return GPT(**SIZES)


def test_the_first_train_loss_is_the_models_own_on_the_first_batch(gpt_run):
    folder, _ = gpt_run
    data = Tokens(size=64)
    x, y = data.inputs[:8], data.targets[:8]
    with torch.no_grad():
        _, loss = _initial_gpt()(x, y)
    first = history(target(folder), "train")[0]
    assert first["step"] == 1 and first["loss"] == pytest.approx(loss.item(), rel=1e-6)
    val = history(target(folder), "val")[-1]
    assert 0 <= val["token_accuracy"] <= 1 and val["perplexity"] > 1


def test_the_optimizer_groups_are_the_hand_split(gpt_run):
    folder, records = gpt_run
    net = _initial_gpt()
    exempt_types = (torch.nn.LayerNorm, torch.nn.Embedding)
    held = {id(p) for m in net.modules() if isinstance(m, exempt_types)
            for p in m.parameters(recurse=False)}
    named = list(net.named_parameters())
    rest = [p for n, p in named if p.ndim < 2 or id(p) in held or n.endswith(".bias")]
    decay = [p for n, p in named if all(p is not q for q in rest)]
    assert {n for n, p in named if any(p is q for q in decay)} == {
        f"blocks.{i}.{w}.weight" for i in range(2) for w in ("attn.qkv", "attn.proj", "mlp.0",
                                                             "mlp.2")}
    state = load(target(folder) / "checkpoint-1.tar")["optimizer_state_dict"]
    groups = state["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    shapes = [[tuple(state["state"][i]["exp_avg"].shape) for i in g["params"]] for g in groups]
    assert shapes == [[tuple(p.shape) for p in decay], [tuple(p.shape) for p in rest]]
    assert (f"optimizer.no_decay: weight_decay 0.1: {len(decay)} tensors, "
            f"{sum(p.numel() for p in decay):,} values; weight_decay 0: {len(rest)} tensors, "
            f"{sum(p.numel() for p in rest):,} values") in records

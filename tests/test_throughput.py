"""Throughput and MFU of the train records: counted FLOPs against a hand count, samples
and tokens per second against a clock that only the network's forward moves, MFU against
its definition, and a run with the FLOPs counted against one without, bit for bit."""

from __future__ import annotations

import time

import pytest
import torch

from echelon3.config.errors import ConfigError
from echelon3.distributed.precision import Precision
from echelon3.observe.peaks import table_peak
from echelon3.tasks.summary import speed_line
from echelon3.trainers.flops import micro_batch_flops
from echelon3.trainers.throughput import Throughput, batch_tokens
from tests.helpers import make_trainer

TICK = 0.25  # seconds of the fake clock per forward


def linear_stack_flops(batch: int, sizes: list[int]) -> int:
    """2·B·in·out per Linear forward; backward: the same again for the weight's gradient
    and for the input's, except the first layer's (the data needs no gradient)."""
    layers = list(zip(sizes, sizes[1:]))
    forward = sum(2 * batch * i * o for i, o in layers)
    inputs_grad = sum(2 * batch * i * o for i, o in layers[1:])
    return forward + forward + inputs_grad


def test_counted_flops_equal_a_hand_count_for_a_linear_stack():
    sizes = [6, 16, 8, 3]
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8),
                              torch.nn.ReLU(), torch.nn.Linear(8, 3))
    batch = (torch.randn(5, 6), torch.randint(0, 3, (5,)))
    flops = micro_batch_flops(net, {"ce": (torch.nn.CrossEntropyLoss(), 1.0)}, batch,
                              Precision("fp32", torch.device("cpu")), list(net.parameters()),
                              torch.device("cpu"))
    assert flops == linear_stack_flops(5, sizes)
    assert all(p.grad is None for p in net.parameters())  # returned, not accumulated


class Ticking(torch.nn.Module):
    """Embedding and Linear over token windows; each forward moves the fake clock."""

    def __init__(self, clock: dict, length: int):
        super().__init__()
        self.clock = clock
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4 * length, 3)

    def forward(self, x):
        self.clock["now"] += TICK
        return self.head(self.embed(x).flatten(1))


def _token_loader(n: int, length: int, batch: int):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 10, (n, length), generator=g),
                                          torch.randint(0, 3, (n,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def test_samples_tokens_step_time_and_mfu_equal_the_counts_over_the_clock(tmp_path,
                                                                          monkeypatch):
    """60 windows of 5 tokens, batches of 16 (the last of 12), 2 micro-batches per step, a
    record every step: each record covers 2 forwards of the fake clock (0.5 s), one
    optimizer step, and the samples of its 2 batches (32, then 28)."""
    clock = {"now": 100.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    test = _token_loader(20, 5, 20)
    trainer = make_trainer(tmp_path, net=Ticking(clock, 5), train_loader=_token_loader(60, 5, 16),
                           test_loaders={"test": test}, epochs=2, grad_accum_steps=2,
                           log_every_n_steps=1, flops_per_step=1e6, peak_flops=1e7)
    trainer.fit()
    train = trainer.logger.split("train")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for record, samples in zip(train, [32, 28, 32, 28]):
        seconds = 2 * TICK  # validation's forwards happen between epochs: not counted
        assert record["samples_per_s"] == pytest.approx(samples / seconds, rel=1e-12)
        assert record["tokens_per_s"] == pytest.approx(5 * samples / seconds, rel=1e-12)
        assert record["step_ms"] == pytest.approx(1e3 * seconds, rel=1e-12)  # per step
        assert record["flops_per_s"] == pytest.approx(1e6 / seconds, rel=1e-12)
        assert record["mfu"] == pytest.approx(1e6 / seconds / 1e7, rel=1e-12)
    summary = trainer.throughput.summary()  # the first record (warm-up) left out
    assert summary["samples_per_s"] == pytest.approx((28 + 32 + 28) / (3 * 2 * TICK))
    assert summary["steps_timed"] == 3 and summary["mfu"] == pytest.approx(0.2)
    assert "MFU 20.0%" in speed_line(summary) and "tokens/s" in speed_line(summary)


def test_a_validation_inside_an_epoch_is_not_counted_as_training_time(tmp_path, monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    trainer = make_trainer(tmp_path, net=Ticking(clock, 5), train_loader=_token_loader(64, 5, 16),
                           test_loaders={"test": _token_loader(40, 5, 10)}, epochs=1,
                           log_every_n_steps=2, val_check_interval=1)
    trainer.fit()
    train = trainer.logger.split("train")
    assert [r["step"] for r in train] == [2, 4]
    assert [r["samples_per_s"] for r in train] == pytest.approx([32 / (2 * TICK)] * 2)


class Noisy(torch.nn.Module):
    """BatchNorm (running statistics, a batch count) and dropout (random masks)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                        torch.nn.Dropout(0.5), torch.nn.ReLU(),
                                        torch.nn.Linear(8, 3))

    def forward(self, x):
        return self.body(x)


def test_counting_the_flops_changes_no_loss_no_weight_and_no_buffer(tmp_path):
    runs = {}
    for name, flops in (("off", None), ("count", "count")):
        torch.manual_seed(0)
        trainer = make_trainer(tmp_path / name, net=Noisy(), epochs=2, log_every_n_steps=1,
                               grad_accum_steps=2, flops_per_step=flops)
        trainer.fit()
        runs[name] = trainer
    off, count = runs["off"], runs["count"]
    assert [r["loss"] for r in off.logger.split("train")] == \
        [r["loss"] for r in count.logger.split("train")]
    for (key, a), b in zip(off.net.state_dict().items(), count.net.state_dict().values()):
        assert torch.equal(a, b), key  # weights, running statistics, num_batches_tracked
    per_micro_batch = linear_stack_flops(16, [4, 8]) + 3 * 2 * 16 * 8 * 3
    assert count.throughput.flops_per_step == 2 * per_micro_batch  # x 2 micro-batches
    assert "mfu" not in count.logger.split("train")[0]  # the CPU has no peak: n/a
    assert count.throughput.summary()["mfu"].startswith("n/a")
    assert "flops_per_s" not in off.logger.split("train")[0]


def test_tokens_are_integer_inputs_of_shape_b_t_or_what_the_key_says():
    ids = torch.zeros(4, 7, dtype=torch.long)
    assert batch_tokens(ids, "auto") == 28
    assert batch_tokens({"input_ids": ids}, "auto") == 28
    assert batch_tokens(torch.zeros(4, 7), "auto") is None  # features, not tokens
    assert batch_tokens(torch.zeros(4, 7, 3), True) == 28
    assert batch_tokens(ids, False) is None


@pytest.mark.parametrize("key,value", [("count_tokens", "yes"), ("flops_per_step", -1),
                                       ("flops_per_step", "many"), ("peak_flops", 0)])
def test_a_bad_setting_names_its_key(key, value):
    with pytest.raises(ConfigError, match=f"trainer.config.{key}: must be"):
        Throughput(**{key: value})


def test_the_peak_table_knows_the_common_gpus_by_their_names():
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert table_peak("NVIDIA H200", "bf16") == 989e12
    assert table_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert table_peak("NVIDIA L40S", "fp16") == 362e12 and table_peak("NVIDIA L4", "fp16") == 121e12
    assert table_peak("NVIDIA A10", "bf16") == 125e12
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 there
    assert table_peak("Some Future GPU", "bf16") is None

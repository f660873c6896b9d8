"""SAMOptimizer: a real sharpness-aware step, two forward/backward passes, any base optimizer."""

from __future__ import annotations

import pytest
import torch

from echelon3.optimizers.sam import SAMOptimizer
from tests.helpers import (ForwardCounter, blobs, echelon3, history, load, make_trainer, target,
                           write_config)


def _loss(net, inputs, labels):
    return torch.nn.functional.cross_entropy(net(inputs), labels)


def _closure(optimizer, net, inputs, labels):
    def closure():
        optimizer.zero_grad()
        loss = _loss(net, inputs, labels)
        loss.backward()
        return loss
    return closure


def test_a_trainer_step_with_sam_does_two_forward_and_backward_passes(tmp_path):
    net = ForwardCounter(torch.nn.Linear(4, 3))
    trainer = make_trainer(tmp_path, net=net, epochs=1,
                           optimizer=lambda p: SAMOptimizer(p, torch.optim.SGD, lr=0.1))
    assert trainer.closure
    steps = len(trainer.train_loader)
    net.train()
    for batch in trainer.train_loader:
        trainer.micro_batch(batch, 1.0, True)
    assert (net.forwards, net.backwards) == (2 * steps, 2 * steps)


def test_the_step_descends_with_the_gradient_at_the_perturbed_point():
    torch.manual_seed(0)
    inputs, labels = blobs(32)
    net = torch.nn.Linear(4, 3)
    w = [p.detach().clone() for p in net.parameters()]
    rho, lr = 0.2, 0.3
    # By hand: g = grad L(w); e = rho g / |g|; w' = w - lr grad L(w + e).
    probe = torch.nn.Linear(4, 3)
    probe.load_state_dict(net.state_dict())
    grads = torch.autograd.grad(_loss(probe, inputs, labels), list(probe.parameters()))
    norm = torch.norm(torch.stack([g.norm() for g in grads]))
    with torch.no_grad():
        for p, g in zip(probe.parameters(), grads):
            p += rho * g / norm
    sharp = torch.autograd.grad(_loss(probe, inputs, labels), list(probe.parameters()))
    expected = [p - lr * g for p, g in zip(w, sharp)]

    optimizer = SAMOptimizer(net.parameters(), torch.optim.SGD, rho=rho, lr=lr)
    loss = optimizer.step(_closure(optimizer, net, inputs, labels))
    for got, want in zip(net.parameters(), expected):
        assert torch.allclose(got, want, atol=1e-6)
    # The returned loss is the one at w, before the climb.
    reference = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p, v in zip(reference.parameters(), w):
            p.copy_(v)
    assert torch.allclose(loss, _loss(reference, inputs, labels))
    # Plain SGD would have landed elsewhere.
    plain = [p - lr * g for p, g in zip(w, grads)]
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(net.parameters(), plain))


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_climb_has_radius_rho_plain_or_scaled_by_the_weights(adaptive):
    torch.manual_seed(0)
    inputs, labels = blobs(32)
    net = torch.nn.Linear(4, 3)
    optimizer = SAMOptimizer(net.parameters(), torch.optim.SGD, rho=0.3, adaptive=adaptive,
                             lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    _closure(optimizer, net, inputs, labels)()
    optimizer.first_step()
    steps = [(p.detach() - b) for p, b in zip(net.parameters(), before)]
    if adaptive:  # ASAM: |e / |w|| = rho
        steps = [s / b.abs() for s, b in zip(steps, before)]
    radius = torch.norm(torch.stack([s.norm() for s in steps]))
    assert torch.isclose(radius, torch.tensor(0.3), atol=1e-4)
    optimizer.second_step()  # back to w, then the base step
    assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


def test_adaptive_changes_the_step():
    results = []
    for adaptive in (False, True):
        torch.manual_seed(0)
        inputs, labels = blobs(32)
        net = torch.nn.Linear(4, 3)
        optimizer = SAMOptimizer(net.parameters(), torch.optim.SGD, rho=0.5, adaptive=adaptive,
                                 lr=0.1)
        optimizer.step(_closure(optimizer, net, inputs, labels))
        results.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
    assert not torch.allclose(results[0], results[1])


@pytest.mark.parametrize("base", [
    torch.optim.Adam,
    "torch.optim.Adam",
    {"module": "torch.optim", "type": "Adam", "config": {"lr": 0.01, "betas": [0.8, 0.9]}},
])
def test_base_optimizer_as_class_name_or_triple(base):
    net = torch.nn.Linear(4, 3)
    kwargs = {} if isinstance(base, dict) else {"lr": 0.01, "betas": (0.8, 0.9)}
    optimizer = SAMOptimizer(net.parameters(), base, rho=0.1, **kwargs)
    assert type(optimizer.base_optimizer) is torch.optim.Adam
    group = optimizer.param_groups[0]
    assert group is optimizer.base_optimizer.param_groups[0]
    assert group["lr"] == 0.01 and tuple(group["betas"]) == (0.8, 0.9) and group["rho"] == 0.1
    inputs, labels = blobs(16)
    optimizer.step(_closure(optimizer, net, inputs, labels))
    assert optimizer.base_optimizer.state[net.weight]["exp_avg"].abs().sum() > 0


def test_base_settings_beside_a_triple_are_rejected():
    spec = {"module": "torch.optim", "type": "SGD", "config": {"lr": 0.1}}
    with pytest.raises(ValueError, match="lr"):
        SAMOptimizer(torch.nn.Linear(2, 2).parameters(), spec, lr=0.5)


def test_a_step_without_closure_and_a_negative_rho_are_refused():
    net = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="closure"):
        SAMOptimizer(net.parameters(), torch.optim.SGD, lr=0.1).step()
    with pytest.raises(ValueError, match="rho"):
        SAMOptimizer(net.parameters(), torch.optim.SGD, rho=-1.0, lr=0.1)


def test_state_dict_round_trip_keeps_the_base_state():
    torch.manual_seed(0)
    inputs, labels = blobs(16)
    net = torch.nn.Linear(4, 3)
    first = SAMOptimizer(net.parameters(), torch.optim.Adam, rho=0.2, lr=0.01)
    first.step(_closure(first, net, inputs, labels))
    state = first.state_dict()
    second = SAMOptimizer(net.parameters(), torch.optim.Adam, rho=0.2, lr=0.5)
    second.load_state_dict(state)
    assert second.param_groups[0]["lr"] == 0.01 and second.param_groups[0]["rho"] == 0.2
    assert second.param_groups is second.base_optimizer.param_groups
    assert torch.equal(second.base_optimizer.state[net.weight]["exp_avg"],
                       first.base_optimizer.state[net.weight]["exp_avg"])


def test_sam_from_the_config_with_a_base_triple_and_a_scheduler(tmp_path):
    write_config(tmp_path, {
        "optimizer": {"module": "echelon3.optimizers.sam", "type": "SAMOptimizer",
                      "config": {"rho": 0.05, "adaptive": True, "base_optimizer": {
                          "module": "torch.optim", "type": "SGD",
                          "config": {"lr": 0.1, "momentum": 0.9}}}},
    }, remove=("optimizer",))
    assert echelon3("train", tmp_path) == 0
    train = history(target(tmp_path), "train")
    assert {r["lr"] for r in train if r["epoch"] == 1} == {0.1}
    assert {round(r["lr"], 8) for r in train if r["epoch"] == 2} == {0.07}  # StepLR, gamma 0.7
    val = history(target(tmp_path), "val")
    assert val[-1]["accuracy"] > val[0]["accuracy"] - 0.1
    state = load(target(tmp_path) / "checkpoint-2.tar")["optimizer_state_dict"]
    assert state["param_groups"][0]["rho"] == 0.05
    assert state["param_groups"][0]["adaptive"] is True
    assert any("momentum_buffer" in s for s in state["state"].values())

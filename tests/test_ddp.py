"""The DDP levers of trainer.config reach DDP and change what it does.

DDP runs here over a one-rank gloo group in the test process: the reducer,
its buckets and the comm hooks work as with more ranks (the average over one
rank is the value itself), which makes each lever's effect exact to check.
The fp16 compression hook runs under gloo; DDP registers the bf16 one only over
NCCL 2.10+ or XCCL, so under gloo it is refused (tested) and its effect is
tested on a GPU (gpu marker).
"""

from __future__ import annotations

import pytest
import torch

from echelon3.config.errors import ConfigError
from echelon3.distributed.ddp import DDP_KEYS, check_settings, wrap
from tests.helpers import single_rank_group


@pytest.fixture
def group(tmp_path):
    with single_rank_group(tmp_path):
        yield


def settings(**levers) -> dict:
    return {"compile": False, "compile_mode": None, **DDP_KEYS, **levers}


def wrapped(frozen_first: bool = False, **levers):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if frozen_first:
        net[0].requires_grad_(False)
    return net, wrap(net, torch.device("cpu"), 2, settings(**levers))


def backward(model, seed: int = 1):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()


def reference_grads(net) -> dict[str, torch.Tensor]:
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    plain.load_state_dict(net.state_dict())
    backward(plain)
    return {n: p.grad for n, p in plain.named_parameters()}


def test_levers_are_forwarded_to_ddp(group):
    for view, static, unused in ((True, False, True), (False, True, False)):
        _, model = wrapped(ddp_gradient_as_bucket_view=view, ddp_static_graph=static,
                           ddp_find_unused_parameters=unused)
        backward(model)
        logged = model._get_ddp_logging_data()  # what the reducer runs with
        assert logged["gradient_as_bucket_view"] == int(view)
        assert logged.get("static_graph", 0) == int(static)  # logged once set
        assert logged["find_unused_parameters"] == int(unused)
        assert model.static_graph is static


def test_gradient_as_bucket_view_makes_grads_views_of_the_buckets(group):
    for view in (True, False):
        net, model = wrapped(ddp_gradient_as_bucket_view=view)
        backward(model)
        assert all(p.grad._is_view() is view for p in net.parameters())


def check_rounded(net, model, comm: str, dtype: torch.dtype) -> None:
    backward(model)
    assert model._get_ddp_logging_data()["comm_hook"] == f"{comm}_compress_hook"
    exact = reference_grads(net)
    for name, p in net.named_parameters():
        assert torch.equal(p.grad, exact[name].to(dtype).float()), name
    assert any(not torch.equal(p.grad, exact[n]) for n, p in net.named_parameters())


def test_fp16_hook_rounds_gradients_to_half_precision(group):
    net, model = wrapped(ddp_comm="fp16")
    check_rounded(net, model, "fp16", torch.float16)


def test_bf16_hook_is_refused_under_gloo_naming_the_key(group):
    """DDP registers the bf16 hook only over NCCL 2.10+ or XCCL."""
    with pytest.raises(ConfigError, match="trainer.config.ddp_comm: bf16 is not supported here"):
        wrapped(ddp_comm="bf16")


@pytest.mark.gpu
def test_bf16_hook_rounds_gradients_over_nccl(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rdzv'}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                  torch.nn.Linear(8, 3)).cuda()
        model = wrap(net, torch.device("cuda", 0), 2, settings(ddp_comm="bf16"))
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)).cuda()
        model(x).pow(2).sum().backward()
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 3)).cuda()
        plain.load_state_dict(net.state_dict())
        plain(x).pow(2).sum().backward()
        for p, q in zip(net.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad.to(torch.bfloat16).float())
        assert model._get_ddp_logging_data()["comm_hook"] == "bf16_compress_hook"
    finally:
        dist.destroy_process_group()


def test_no_compression_keeps_exact_gradients(group):
    net, model = wrapped(ddp_comm="none")
    backward(model)
    assert "comm_hook" not in model._get_ddp_logging_data()
    exact = reference_grads(net)
    for name, p in net.named_parameters():
        assert torch.allclose(p.grad, exact[name], rtol=0, atol=1e-7), name


def test_frozen_parameters_are_not_registered_with_ddp(group):
    net, model = wrapped(frozen_first=True, ddp_find_unused_parameters=True)
    logged = model._get_ddp_logging_data()
    assert logged["num_parameter_tensors"] == 2  # the last Linear's weight and bias only
    backward(model)
    assert net[0].weight.grad is None and net[2].weight.grad is not None


def test_profiled_all_reduce_is_labelled_and_keeps_the_hook(group):
    net, _ = wrapped()
    model = wrap(net, torch.device("cpu"), 2, settings(ddp_comm="fp16"), label_allreduce=True)
    with torch.profiler.profile() as prof:
        backward(model)
    assert "all_reduce" in {e.name for e in prof.events()}
    assert model._get_ddp_logging_data()["comm_hook"] == "fp16_compress_hook"


@pytest.mark.parametrize("key,value", [("ddp_comm", "int8"), ("ddp_static_graph", "yes"),
                                       ("ddp_gradient_as_bucket_view", 1)])
def test_bad_lever_names_its_key(key, value):
    with pytest.raises(ConfigError, match=f"trainer.config.{key}"):
        check_settings(settings(**{key: value}))


class Skipping(torch.nn.Module):
    """A branch that one step never takes: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.skipped = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("net, unused, hinted", [
    (torch.nn.Linear(4, 3), True, True),   # the search found nothing: say the key
    (Skipping(), True, False),             # it found the skipped branch: it was needed
    (torch.nn.Linear(4, 3), False, False),  # no search, nothing to say
])
def test_the_unused_parameter_search_is_named_only_when_it_found_nothing(
        group, caplog, net, unused, hinted):
    from echelon3.distributed.ddp import hint_unused_search

    model = wrap(net, torch.device("cpu"), 2, settings(ddp_find_unused_parameters=unused))
    backward(model)
    assert hint_unused_search(model) is not unused  # DDP's figures: from the next forward
    backward(model)
    with caplog.at_level("WARNING", logger="echelon3.distributed.ddp"):
        assert hint_unused_search(model)
    said = [r.getMessage() for r in caplog.records if "ddp_find_unused_parameters" in r.getMessage()]
    assert len(said) == int(hinted), said

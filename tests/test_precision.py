"""Precision selection, the GradScaler's state in checkpoints, TF32/cudnn flags, compile."""

from __future__ import annotations

import logging

import pytest
import torch

from echelon3.config.errors import ConfigError
from echelon3.distributed.ddp import wrap
from echelon3.distributed.precision import Precision, resolve_mode
from echelon3.tasks.train import runtime_settings
from tests.conftest import run_cli

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("requested,expected", [
    (None, "fp32"), ("auto", "fp32"), ("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"),
    ("BF16", "bf16")])
def test_modes_on_cpu(requested, expected):
    assert resolve_mode(requested, CPU) == expected


@pytest.mark.parametrize("supported,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_gpu_is_bf16_where_supported(monkeypatch, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert resolve_mode("auto", CUDA) == expected
    assert resolve_mode(None, CUDA) == expected


def test_unknown_precision_names_the_key():
    with pytest.raises(ConfigError, match=r"^trainer\.config\.precision: unknown precision 'fp8'"):
        resolve_mode("fp8", CPU)
    with pytest.raises(ConfigError, match=r"^precision: "):
        resolve_mode("half", CPU, key="precision")


def test_fp16_with_a_closure_optimizer_falls_back_to_bf16_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_mode("fp16", CPU, closure=True) == "bf16"
    assert "closure optimizers" in caplog.text and "bf16" in caplog.text
    assert resolve_mode("bf16", CPU, closure=True) == "bf16"


def test_fp32_disables_autocast_and_bf16_enables_it():
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with Precision("fp32", CPU).autocast():
        assert layer(x).dtype == torch.float32
    with Precision("bf16", CPU).autocast():
        assert layer(x).dtype == torch.bfloat16
    assert Precision("bf16", CPU).scaler is None and Precision("fp32", CPU).scaler is None


def test_fp16_has_a_scaler_whose_state_round_trips():
    p = Precision("fp16", CPU)
    assert p.scaler is not None
    state = p.state_dict()
    state["scale"] = 1024.0
    q = Precision("fp16", CPU)
    q.load_state_dict(state)
    assert q.state_dict()["scale"] == 1024.0


def test_tf32_and_cudnn_flags_follow_the_config():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark)
    try:
        Precision.from_config(CUDA, "fp32", tf32=False, cudnn_benchmark=False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cudnn.benchmark
        Precision.from_config(CUDA, "fp32", tf32=True, cudnn_benchmark=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.benchmark
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved


def test_fp16_scaler_state_is_checkpointed_and_resumed(probe):
    config_dir, write = probe
    write(epochs=1)
    first = run_cli(["train", "-cd", str(config_dir), "-cn", "probe",
                     "trainer.config.precision=fp16"])
    assert first.returncode == 0, first.stderr
    assert "precision fp16" in first.stderr
    state = torch.load(config_dir / "run" / "checkpoint-1.tar", weights_only=True)
    scaler = state["scaler_state_dict"]
    assert scaler is not None and scaler["scale"] > 0 and "_growth_tracker" in scaler
    assert scaler["_growth_tracker"] == 8  # one growth-tracker tick per successful step

    second = run_cli(["train", "-cd", str(config_dir), "-cn", "probe",
                      "trainer.config.precision=fp16", "trainer.config.epochs=2"])
    assert second.returncode == 0, second.stderr
    resumed = torch.load(config_dir / "run" / "checkpoint-2.tar", weights_only=True)
    assert resumed["scaler_state_dict"]["_growth_tracker"] == 16  # continued, not reset


def test_closure_optimizer_under_fp16_trains_in_bf16(probe):
    config_dir, write = probe
    write(epochs=1, extra={"optimizer": {"module": "echelon3.optimizers.sam",
                                         "type": "SAMOptimizer",
                                         "config": {"base_optimizer": "torch.optim.SGD",
                                                    "lr": 0.1}}})
    result = run_cli(["train", "-cd", str(config_dir), "-cn", "probe",
                      "trainer.config.precision=fp16"])
    assert result.returncode == 0, result.stderr
    assert "fp16 is not supported with closure optimizers" in result.stderr
    assert "precision bf16" in result.stderr
    state = torch.load(config_dir / "run" / "checkpoint-1.tar", weights_only=True)
    assert state["scaler_state_dict"] is None


def test_evaluate_and_run_autocast_from_the_root_precision_key(probe):
    config_dir, write = probe
    write(epochs=1)
    assert run_cli(["train", "-cd", str(config_dir), "-cn", "probe"]).returncode == 0
    for task in ("evaluate", "run"):
        default = run_cli([task, "-cd", str(config_dir), "-cn", "probe"])
        assert default.returncode == 0 and "precision fp32" in default.stderr  # auto on CPU
        forced = run_cli([task, "-cd", str(config_dir), "-cn", "probe", "precision=bf16"])
        assert forced.returncode == 0 and "precision bf16" in forced.stderr, forced.stderr
    bad = run_cli(["evaluate", "-cd", str(config_dir), "-cn", "probe", "precision=fp12"])
    assert bad.returncode == 2 and bad.stderr.startswith("echelon3: error: precision:")


def _settings(**given):
    from omegaconf import OmegaConf

    return runtime_settings(OmegaConf.create({"trainer": {"config": given}}))


def test_runtime_settings_defaults_and_validation():
    assert _settings() == {"precision": None, "tf32": True, "cudnn_benchmark": True,
                           "compile": False, "compile_mode": None,
                           "ddp_find_unused_parameters": True, "ddp_comm": "none",
                           "ddp_gradient_as_bucket_view": True, "ddp_static_graph": False,
                           "extend": None, "limit_val_batches": None}
    with pytest.raises(ConfigError, match="trainer.config.compile_mode"):
        _settings(compile_mode="fastest")
    with pytest.raises(ConfigError, match="trainer.config.compile"):
        _settings(compile="yes")


def test_compile_wraps_before_ddp_and_checkpoints_drop_the_prefix():
    from echelon3.checkpoints.files import strip_prefixes
    from echelon3.distributed.ranks import unwrap

    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model = wrap(net, CPU, 1, _settings(compile=True, compile_mode="reduce-overhead"))
    assert model is not net and hasattr(model, "_orig_mod")
    assert all(k.startswith("_orig_mod.") for k in model.state_dict())
    assert unwrap(model) is net
    assert set(strip_prefixes(model.state_dict())) == set(net.state_dict())
    assert wrap(net, CPU, 1, _settings()) is net


def test_ddp_find_unused_parameters_reaches_the_wrapper(monkeypatch):
    import torch.nn.parallel as parallel

    seen = {}

    class FakeDDP:
        def __init__(self, module, device_ids=None, find_unused_parameters=None,
                     gradient_as_bucket_view=None, static_graph=None):
            seen.update(module=module, find=find_unused_parameters, ids=device_ids,
                        bucket_view=gradient_as_bucket_view, static=static_graph)

    monkeypatch.setattr(parallel, "DistributedDataParallel", FakeDDP)
    net = torch.nn.Linear(2, 2)
    wrap(net, CPU, 2, _settings())
    assert seen == {"module": net, "find": True, "ids": None, "bucket_view": True,
                    "static": False}
    wrap(net, CPU, 2, _settings(ddp_find_unused_parameters=False))
    assert seen["find"] is False


def test_compiled_training_round_trips_checkpoints(probe):
    """torch.compile for real (CPU inductor): trains, and its checkpoint loads uncompiled."""
    config_dir, write = probe
    write(epochs=1, train_size=32, batch=16)
    result = run_cli(["train", "-cd", str(config_dir), "-cn", "probe",
                      "trainer.config.compile=true"], timeout=600)
    assert result.returncode == 0, result.stderr
    assert "compiled" in result.stderr
    state = torch.load(config_dir / "run" / "best.tar", weights_only=True)
    assert set(state["model_state_dict"]) == {"fc.weight", "fc.bias"}
    resumed = run_cli(["train", "-cd", str(config_dir), "-cn", "probe",
                       "trainer.config.epochs=2"])
    assert resumed.returncode == 0 and "Resuming from" in resumed.stderr, resumed.stderr

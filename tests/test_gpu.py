"""Behaviour that only a CUDA GPU can show. Skipped, with the reason, on CPU-only machines."""

from __future__ import annotations

import pytest
import torch

from echelon3.precision import Precision, resolve_mode
from tests.conftest import run_cli

pytestmark = pytest.mark.gpu


def test_auto_is_bf16_on_a_gpu_that_supports_it():
    device = torch.device("cuda", 0)
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    assert resolve_mode("auto", device) == expected


@pytest.mark.parametrize("mode,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                        ("fp32", torch.float32)])
def test_autocast_dtype_on_gpu(mode, dtype):
    device = torch.device("cuda", 0)
    layer = torch.nn.Linear(16, 16).to(device)
    with Precision(mode, device).autocast():
        assert layer(torch.randn(4, 16, device=device)).dtype == dtype


def test_single_gpu_training_run(probe):
    config_dir, write = probe
    write(epochs=1, extra={"device": "cuda", "gpus": [0]})
    result = run_cli(["train", "-cd", str(config_dir), "-cn", "probe",
                      "~trainer.config.precision"])
    assert result.returncode == 0, result.stderr
    assert "training on cuda:0" in result.stderr and "precision bf16" in result.stderr


def test_gpu_index_beyond_the_node_is_an_error(probe):
    config_dir, write = probe
    write(epochs=1, extra={"device": "cuda"})
    missing = torch.cuda.device_count()
    result = run_cli(["train", "-cd", str(config_dir), "-cn", "probe", f"gpus=[{missing}]"])
    assert result.returncode == 2 and f"gpus: GPU {missing} does not exist" in result.stderr

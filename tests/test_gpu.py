"""Behaviour that only a CUDA GPU can show. Skipped, with the reason, on CPU-only machines."""

from __future__ import annotations

import pytest
import torch

from echelon3.distributed.precision import Precision, resolve_mode
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


def test_no_host_sync_between_log_points(tmp_path):
    """On a GPU the loop waits for the device only at log points, and there only for
    work that finished an interval ago: counted with torch's sync debug mode (a warning
    per synchronizing call) and a counting ``Tensor.item``, per optimizer step."""
    import warnings

    from tests.helpers import blobs, make_trainer

    device = torch.device("cuda", 0)
    inputs, labels = blobs(256)
    data = torch.utils.data.TensorDataset(inputs, labels)
    trainer = make_trainer(tmp_path, net=torch.nn.Linear(4, 3).to(device), epochs=1,
                           log_every_n_steps=4,
                           train_loader=torch.utils.data.DataLoader(data, batch_size=16))
    trainer.device, trainer.move = device, True
    trainer.precision = Precision("bf16", device)
    trainer.stepping.precision = trainer.precision
    trainer.running.device = device
    marks: list[tuple[int, int]] = []
    items = [0]
    original_item, original_step = torch.Tensor.item, trainer.micro_batch

    def counting_item(self):
        items[0] += 1
        return original_item(self)

    def marked(*args, **kwargs):
        marks.append((trainer.global_step, len(caught) + items[0]))
        return original_step(*args, **kwargs)

    trainer.micro_batch = marked
    torch.cuda.set_sync_debug_mode("warn")
    torch.Tensor.item = counting_item
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.Tensor.item = original_item
    # syncs from entering step s + 1's micro-batch to entering step s + 2's: step s + 1
    # itself and the log point after it
    per_step = {step + 1: after - before for (step, before), (_, after) in zip(marks, marks[1:])}
    for step, syncs in per_step.items():
        if step == 1:
            continue  # first-call set-up
        assert syncs <= (1 if step % 4 == 0 else 0), (step, syncs, per_step)


def test_fsdp_bf16_policy_over_nccl():
    """benchmarks/fsdp_gpu_check.py's in-process rows: NCCL, bf16 policy, sharded save."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import torch, benchmarks.fsdp_gpu_check as c, benchmarks.gpu_check as t; "
            "c.check_policy(torch.device('cuda', 0)); raise SystemExit(t.failures)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]

"""What a device can do at most: dense matrix-multiply FLOP/s by GPU and number format.

MFU (model FLOPs utilisation) divides the FLOP/s a run achieves by this peak. The
figures are the vendors' dense (not 2:4 sparse) tensor-core peaks of one GPU, in
FLOP/s; ``tf32`` is what fp32 matrix multiplies reach with TF32 allowed, ``fp32`` without
it. A GPU not listed here, or the CPU, has no peak: ``trainer.config.peak_flops`` gives one.
"""

from __future__ import annotations

import re

import torch

T = 1e12

# (pattern on torch.cuda.get_device_name, {format: dense FLOP/s}); the first match wins,
# so a name that contains another (H100 PCIe, L40S) comes before it.
PEAKS: list[tuple[str, dict[str, float]]] = [
    (r"B200", {"bf16": 2250 * T, "fp16": 2250 * T, "tf32": 1100 * T, "fp32": 75 * T}),
    (r"H200", {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T, "fp32": 67 * T}),
    (r"H100.*NVL", {"bf16": 835 * T, "fp16": 835 * T, "tf32": 418 * T, "fp32": 60 * T}),
    (r"H100.*PCIe", {"bf16": 756 * T, "fp16": 756 * T, "tf32": 378 * T, "fp32": 51 * T}),
    (r"H100", {"bf16": 989 * T, "fp16": 989 * T, "tf32": 494 * T, "fp32": 67 * T}),  # SXM
    (r"A100", {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),
    (r"L40S", {"bf16": 362 * T, "fp16": 362 * T, "tf32": 183 * T, "fp32": 91.6 * T}),
    (r"\bL4\b", {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T}),
    (r"\bA10\b", {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T}),
    (r"V100", {"fp16": 125 * T, "fp32": 15.7 * T}),
]


def number_format(precision_mode: str, cuda: bool = True) -> str:
    """The format a run's matrix multiplies use: bf16, fp16, tf32 or fp32."""
    if precision_mode in ("bf16", "fp16"):
        return precision_mode
    return "tf32" if cuda and torch.backends.cuda.matmul.allow_tf32 else "fp32"


def table_peak(device_name: str, fmt: str) -> float | None:
    """The peak of ``device_name`` in ``fmt`` from :data:`PEAKS`, or None."""
    for pattern, peaks in PEAKS:
        if re.search(pattern, device_name):
            return peaks.get(fmt)
    return None


def device_peak(device, precision_mode: str) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, what it is) for a run on ``device`` in
    ``precision_mode``; the peak is None on the CPU and on GPUs not in the table."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"{device.type}: no peak known"
    name = torch.cuda.get_device_name(device)
    fmt = number_format(precision_mode)
    peak = table_peak(name, fmt)
    return peak, f"{name} {fmt}" + ("" if peak else ": not in the peak table")

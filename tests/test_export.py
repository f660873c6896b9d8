"""echelon3 export: ONNX parity with PyTorch in onnxruntime, dynamic batch, safetensors,
the exporter fallback, and the one-line error without the optional extra.

Parity is checked on the whole digits test set (450 samples): raw pixel values
go into the graph, which standardises them, runs the network and returns
probabilities. Tolerance: |ONNX - PyTorch| <= 1e-5 per probability, and the
same argmax on at least 99.9% of the samples (here: all of them).
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

from echelon3.datasets.digits import Digits
from echelon3.nets.mlp import MLP
from echelon3.export import Exported, Standardize, onnx_outputs, to_onnx
from tests.helpers import echelon3, load, write_config

PROB_ATOL = 1e-5
ARGMAX_AGREEMENT = 0.999


def _stats() -> tuple[float, float]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, *_ = train_test_split(data.images.astype(np.float32) / 16.0, data.target,
                                   test_size=0.25, random_state=0, stratify=data.target)
    return float(x_train.mean()), float(x_train.std())


@pytest.fixture(scope="module")
def exported(trained):
    mean, std = _stats()
    overrides = [
        "+export.formats=[onnx,safetensors]",
        "+export.preprocess={module: echelon3.export, type: Standardize, config: "
        f"{{mean: {mean!r}, std: {std!r}, scale: 0.0625}}}}",
        "+export.postprocess={module: torch.nn, type: Softmax, config: {dim: 1}}",
        "+export.input={shape: [1, 8, 8], dtype: float32}",
    ]
    assert echelon3("export", trained, *overrides) == 0
    return trained / "out"


def test_onnx_matches_pytorch_on_the_test_set(exported):
    mean, std = _stats()
    test = Digits("test")
    raw = ((test.images * std + mean) * 16.0).round()  # pixels 0-16, as load_digits has them
    net = MLP(hidden=32)
    net.load_state_dict(load(exported / "best.tar")["model_state_dict"])
    net.eval()
    with torch.no_grad():
        expected = torch.softmax(net(test.images), dim=1).numpy()
    got = onnx_outputs(exported / "model.onnx", raw)
    assert got.shape == (450, 10)
    assert np.abs(got - expected).max() <= PROB_ATOL
    assert (got.argmax(1) == expected.argmax(1)).mean() >= ARGMAX_AGREEMENT
    for batch in (1, 7):  # dynamic batch size
        assert onnx_outputs(exported / "model.onnx", raw[:batch]).shape == (batch, 10)


def test_safetensors_hold_the_checkpoint_weights(exported):
    from safetensors.torch import load_file

    weights = load_file(exported / "model.safetensors")
    state = load(exported / "best.tar")["model_state_dict"]
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)


def test_falls_back_to_the_torchscript_exporter_and_says_so(tmp_path, monkeypatch, caplog):
    real = torch.onnx.export

    def dynamo_fails(*args, dynamo=True, **kwargs):
        if dynamo:
            raise RuntimeError("unsupported operator for this test")
        return real(*args, dynamo=False, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_fails)
    model = Exported(torch.nn.Linear(4, 3), Standardize(1.0, 2.0)).eval()
    with caplog.at_level(logging.WARNING, logger="echelon3.export"):
        used = to_onnx(model, torch.randn(2, 4), tmp_path / "m.onnx", True, None)
    assert used == "torchscript"
    assert "dynamo exporter failed (unsupported operator for this test); falling back" \
        in caplog.text
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert np.allclose(onnx_outputs(tmp_path / "m.onnx", x), model(x).numpy(), atol=1e-6)


def test_without_the_extra_export_fails_in_one_line(tmp_path, monkeypatch, capsys):
    write_config(tmp_path)
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript -> ImportError
    assert echelon3("export", tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("echelon3: error: export: needs the optional extra 'export' (onnxscript not "
                   "installed): pip install 'echelon3[export]'")

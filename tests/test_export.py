"""echelon3 export: ONNX parity with PyTorch in onnxruntime, dynamic batch, safetensors,
the exporter fallback, the one-line error without the optional extra, the contract
(model.json and the graph's metadata), the missing-preprocess warning, the batch-size
checks, and echelon3 predict scoring the file on raw inputs as evaluate scores the
checkpoint.

Parity is checked on the whole digits test set (450 samples): raw pixel values
go into the graph, which standardises them, runs the network and returns
probabilities. Tolerance: |ONNX - PyTorch| <= 1e-5 per probability, and the
same argmax on at least 99.9% of the samples (here: all of them).
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest
import torch

from echelon3.config.errors import ConfigError
from echelon3.datasets.digits import Digits
from echelon3.nets.mlp import MLP
from echelon3.tasks.export import Exported, Standardize, check, onnx_outputs, preprocessing, to_onnx
from tests.helpers import echelon3, load, write_config

PROB_ATOL = 1e-5
ARGMAX_AGREEMENT = 0.999
SCORE_ATOL = 1e-6  # model.onnx on raw inputs vs evaluate on the checkpoint


class BatchAsInt(MLP):
    """MLP(hidden=32)'s weights, but a forward that reads the batch size as a Python int."""

    def forward(self, x):
        return self.layers(x.reshape(int(x.shape[0]), -1))


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
        "+export.preprocess={module: echelon3.nets.preprocess, type: Standardize, config: "
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
    with caplog.at_level(logging.WARNING, logger="echelon3.tasks.export"):
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


def test_digits_declares_its_standardisation_exactly():
    mean, std = _stats()  # computed here from sklearn, independently of Digits
    test = Digits("test")
    assert (test.preprocess.mean, test.preprocess.std, test.preprocess.scale) == \
        (mean, std, 1 / 16)
    assert torch.equal(test.preprocess(test.raw), test.images)
    assert test.raw.max() == 16 and torch.equal(test.raw, test.raw.round())


def test_model_json_and_the_graph_metadata_carry_the_contract(exported):
    import onnxruntime

    from echelon3 import __version__

    contract = json.loads((exported / "model.json").read_text())
    session = onnxruntime.InferenceSession(str(exported / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    graph_in, graph_out = session.get_inputs()[0], session.get_outputs()[0]
    assert contract["input"]["name"] == graph_in.name == "input"
    assert contract["input"]["shape"] == graph_in.shape == ["batch", 1, 8, 8]
    assert contract["input"]["dtype"] == "float32" and graph_in.type == "tensor(float)"
    assert contract["output"]["shape"] == graph_out.shape == ["batch", 10]
    assert contract["output"]["is"] == \
        "probabilities over 10 classes (Softmax(dim=1) of the logits)"
    mean, std = _stats()
    assert contract["preprocess"].startswith(
        f"Standardize(mean={mean!r}, std={std!r}, scale=0.0625) (from export.preprocess)")
    assert contract["source"] == str(exported / "best.tar")
    assert contract["echelon3_version"] == __version__
    meta = session.get_modelmeta().custom_metadata_map
    assert meta["input_name"] == "input" and meta["input_dtype"] == "float32"
    assert json.loads(meta["input_shape"]) == ["batch", 1, 8, 8]
    assert meta["preprocess"] == contract["preprocess"]
    assert meta["output_is"] == contract["output"]["is"]


def test_predict_scores_model_onnx_on_raw_inputs_as_evaluate_scores_the_checkpoint(exported):
    assert echelon3("evaluate", exported.parent) == 0
    assert echelon3("predict", exported.parent) == 0
    evaluated = json.loads((exported / "metrics.json").read_text())
    predicted = json.loads((exported / "model.metrics.json").read_text())
    assert predicted.keys() == {"accuracy"}
    assert abs(predicted["accuracy"] - evaluated["accuracy"]) <= SCORE_ATOL
    # and independently: the graph on raw test pixels, argmax against the labels
    test = Digits("test", limit=96)
    got = onnx_outputs(exported / "model.onnx", test.raw).argmax(1)
    assert abs((got == test.labels.numpy()).mean() - predicted["accuracy"]) <= SCORE_ATOL


def test_export_without_preprocess_warns_what_the_model_expects(trained, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="echelon3.tasks.export"):
        assert echelon3("export", trained, f"+export.output={tmp_path}") == 0
    assert "the test set (Digits) transforms its inputs (Standardize(mean=" in caplog.text
    assert "model.onnx expects transformed inputs, not raw ones; set export.preprocess: " \
        "dataset" in caplog.text
    contract = json.loads((tmp_path / "model.json").read_text())
    assert contract["preprocess"] is None
    assert contract["input"]["is"].startswith("inputs already transformed as the test set "
                                              "(Digits) transforms them: Standardize(mean=")
    assert contract["output"]["is"] == "logits over 10 classes"


def test_preprocess_dataset_needs_a_set_that_declares_one():
    plain = torch.utils.data.TensorDataset(torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ConfigError, match=r"^export.preprocess: 'dataset' takes the test set's "
                       r"declared transform, but TensorDataset declares none"):
        preprocessing({"preprocess": "dataset"}, plain, None)


def test_a_batch_read_as_a_python_int_is_an_error_not_a_fixed_batch(trained, tmp_path, capsys):
    code = echelon3("export", trained, "net.module=tests.test_export", "net.type=BatchAsInt",
                    f"+export.output={tmp_path}")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(
        "echelon3: error: export.dynamic_batch: is true, but the graph came out with a fixed "
        "batch of 2 (the example's): the network's forward (tests.test_export.BatchAsInt."
        "forward) likely turns the batch size into a Python number (int(x.shape[0])")
    assert not (tmp_path / "model.onnx").exists()
    assert echelon3("export", trained, "net.module=tests.test_export", "net.type=BatchAsInt",
                    f"+export.output={tmp_path}", "+export.dynamic_batch=false") == 0
    x = Digits("test", limit=2).raw
    assert onnx_outputs(tmp_path / "model.onnx", x).shape == (2, 10)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # int(x.shape[0]), on purpose
def test_the_torchscript_fallback_is_checked_at_other_batch_sizes(tmp_path, monkeypatch):
    real = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *a, dynamo=True, **k:
                        real(*a, dynamo=False, **k) if not dynamo else 1 / 0)
    model = Exported(BatchAsInt(hidden=8)).eval()
    example = torch.rand(2, 1, 8, 8)
    assert to_onnx(model, example, tmp_path / "m.onnx", True, None) == "torchscript"
    with pytest.raises(ConfigError, match=r"^export.dynamic_batch: is true, but onnxruntime "
                       r"fails at batch size 1 \("):
        check(model, tmp_path / "m.onnx", example, dynamic_batch=True)
    good = Exported(MLP(hidden=8)).eval()
    to_onnx(good, example, tmp_path / "good.onnx", True, None)
    assert check(good, tmp_path / "good.onnx", example, dynamic_batch=True) <= 1e-5
    for batch in (1, 64):
        x = torch.rand(batch, 1, 8, 8)
        with torch.no_grad():
            assert np.allclose(onnx_outputs(tmp_path / "good.onnx", x), good(x).numpy(),
                               atol=1e-5)


def test_predict_without_an_exported_file_says_how_to_make_one(tmp_path, capsys):
    write_config(tmp_path)
    assert echelon3("predict", tmp_path) == 2
    assert capsys.readouterr().err.strip() == (
        f"echelon3: error: {tmp_path / 'out' / 'model.onnx'}: not found; write it first with "
        "echelon3 export (same config)")

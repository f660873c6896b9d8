"""``echelon3 export``: a checkpoint's network as ONNX and/or safetensors weights.

```yaml
export:
  formats: [onnx]          # onnx | safetensors (both: [onnx, safetensors])
  checkpoint: null         # default best.tar under target.path (else the newest rolling one)
  output: null             # folder for model.onnx / model.json / model.safetensors;
                           # default target.path
  preprocess: null         # raw input -> network input, fused in front of the network:
                           # {module, type, config}, or `dataset` for the test set's own
                           # declared transform (its `preprocess` attribute)
  postprocess: null        # {module, type, config}: network output -> final output
  input: null              # {shape: [1, 8, 8], dtype: float32}: one raw sample; default:
                           # the first test-set inputs (raw ones when the set declares them)
  dynamic_batch: true      # the batch dimension of input and output is symbolic
  opset: null              # ONNX opset; null = the exporter's default
```

The ONNX graph is ``postprocess(net(preprocess(input)))``. It is written by
``torch.onnx.export(..., dynamo=True)`` (torch.export + onnxscript, the exporter
PyTorch recommends); if that exporter cannot handle the network, the
TorchScript-based one is tried and a warning says so. The written graph is run
in onnxruntime and compared with PyTorch on the example batch and, with
``dynamic_batch``, at batch sizes 1 and 3; a graph whose batch came out fixed is
an error naming the cause. What the graph takes and returns is written into its
metadata and into ``model.json`` (see :mod:`echelon3.tasks.contract`).

A dataset that transforms its inputs declares it with a ``preprocess`` attribute
(a module: raw inputs -> the inputs it returns) and, so export can feed raw
examples and ``echelon3 predict`` can score on raw inputs, a ``raw_input(index)``
method. Exporting without ``export.preprocess`` from such a test set warns: the
graph then expects transformed inputs. ``onnx``, ``onnxscript``, ``onnxruntime``
and ``safetensors`` come with the optional extra ``pip install 'echelon3[export]'``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from echelon3.config.errors import ConfigError, UserError
from echelon3.nets.preprocess import Standardize  # noqa: F401  (configs name echelon3.tasks.export)

log = logging.getLogger(__name__)

FORMATS = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "safetensors": ("safetensors",)}
KEYS = ("formats", "checkpoint", "output", "preprocess", "postprocess", "input",
        "dynamic_batch", "opset")
CHECK_ATOL = 1e-4  # largest |ONNX - PyTorch| accepted on the checked batches (fp32)
PREPROCESS_ATOL = 1e-6  # export.preprocess(raw) vs the test set's own inputs
FROM_DATASET = "dataset"  # export.preprocess: dataset -> the test set's declared transform


class Exported(nn.Module):
    """``postprocess(net(preprocess(x)))``; a missing end is the identity."""

    def __init__(self, net: nn.Module, preprocess: nn.Module | None = None,
                 postprocess: nn.Module | None = None):
        super().__init__()
        self.preprocess = preprocess or nn.Identity()
        self.net = net
        self.postprocess = postprocess or nn.Identity()

    def forward(self, x):
        return self.postprocess(self.net(self.preprocess(x)))


def settings(cfg) -> dict[str, Any]:
    """The ``export`` section, checked, with defaults."""
    from echelon3.config.build import to_plain

    node = to_plain(cfg.get("export")) or {}
    if node is True:
        node = {}
    if not isinstance(node, dict):
        raise ConfigError("export", f"must be a mapping with keys {', '.join(KEYS)}, got {node!r}")
    for key in node:
        if key not in KEYS:
            raise ConfigError(f"export.{key}", f"unknown key; export takes {', '.join(KEYS)}")
    out = {"formats": ["onnx"], "dynamic_batch": True, **node}
    formats = [out["formats"]] if isinstance(out["formats"], str) else out["formats"]
    if not isinstance(formats, list) or not formats or any(f not in FORMATS for f in formats):
        raise ConfigError("export.formats", f"must list one or more of {', '.join(FORMATS)}, "
                          f"got {out['formats']!r}")
    out["formats"] = formats
    if not isinstance(out["dynamic_batch"], bool):
        raise ConfigError("export.dynamic_batch", f"must be true or false, got "
                          f"{out['dynamic_batch']!r}")
    pre = out.get("preprocess")
    if pre is not None and not isinstance(pre, dict) and pre != FROM_DATASET:
        raise ConfigError("export.preprocess", "must be {module, type, config} or "
                          f"'{FROM_DATASET}' (the test set's declared transform), got {pre!r}")
    return out


def require_extra(formats: list[str]) -> None:
    """Fail in one line, naming the extra, when a format's packages are not installed."""
    missing = []
    for name in (m for f in formats for m in FORMATS[f]):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise UserError("export", f"needs the optional extra 'export' ({', '.join(missing)} "
                        "not installed): pip install 'echelon3[export]'")


def first_test_set(cfg, config_dir):
    """The first test set, or None without ``data.test`` (``export.input`` then says it all)."""
    from echelon3.tasks import components

    if (cfg.get("data") or {}).get("test") is None:
        return None
    _, tests, _ = components.build_datasets(cfg, config_dir, train=False)
    return next(iter(tests.values()))


def declared_transform(dataset) -> nn.Module | None:
    """The dataset's own input transform (its ``preprocess`` attribute), if it declares one."""
    pre = getattr(dataset, "preprocess", None)
    return pre if isinstance(pre, nn.Module) else None


def preprocessing(spec, dataset, config_dir) -> tuple[nn.Module | None, str | None]:
    """``export.preprocess`` built -> (module, where it came from); warns when it is missing
    although the test set transforms its inputs."""
    from echelon3.config import build

    declared = declared_transform(dataset)
    name = type(dataset).__name__
    if spec.get("preprocess") == FROM_DATASET:
        if dataset is None:
            raise ConfigError("export.preprocess", f"'{FROM_DATASET}' takes the test set's "
                              "declared transform, but there is no data.test")
        if declared is None:
            raise ConfigError("export.preprocess", f"'{FROM_DATASET}' takes the test set's "
                              f"declared transform, but {name} declares none (no 'preprocess' "
                              "attribute); give {module, type, config}")
        return declared, f"export.preprocess: {FROM_DATASET}, {name}.preprocess"
    if spec.get("preprocess"):
        pre = build.instantiate(spec["preprocess"], "export.preprocess", config_dir)
        return pre, "export.preprocess"
    if declared is not None:
        log.warning("export: the test set (%s) transforms its inputs (%r) and export.preprocess "
                    "is not set, so model.onnx expects transformed inputs, not raw ones; set "
                    "export.preprocess: %s to fuse the transform", name, declared, FROM_DATASET)
    return None, None


def example_input(dataset, spec, raw: bool) -> torch.Tensor:
    """A batch of two inputs: ``export.input``'s shape and dtype, or the test set's first
    two (their raw form when ``raw`` and the set has one)."""
    shape = spec.get("input")
    if shape is not None:
        if not isinstance(shape, dict) or not isinstance(shape.get("shape"), list):
            raise ConfigError("export.input", "must be {shape: [sizes of one sample], "
                              f"dtype: float32}}, got {shape!r}")
        dtype = getattr(torch, str(shape.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("export.input.dtype", f"not a torch dtype: {shape.get('dtype')!r}")
        return (torch.rand(2, *shape["shape"]) * 4).to(dtype)
    if dataset is None:
        raise ConfigError("export.input", "needed without data.test: give "
                          "{shape: [sizes of one sample], dtype: float32}")
    indices = [0, min(1, len(dataset) - 1)]
    if raw and hasattr(dataset, "raw_input"):
        return torch.stack([torch.as_tensor(dataset.raw_input(i)) for i in indices])
    return test_inputs(dataset, indices)


def test_inputs(dataset, indices) -> torch.Tensor:
    from echelon3.data.batches import split_batch

    inputs, _ = split_batch(torch.utils.data.default_collate([dataset[i] for i in indices]))
    if not isinstance(inputs, torch.Tensor):
        raise ConfigError("export.input", "the test set's inputs are not one tensor; give "
                          "export.input: {shape: [...], dtype: ...}")
    return inputs


def check_preprocess(pre: nn.Module, dataset, example: torch.Tensor) -> None:
    """A preprocess that does not turn raw inputs into the test set's own inputs makes a
    graph that scores less than evaluate on raw data: say so."""
    if not hasattr(dataset, "raw_input") or declared_transform(dataset) is None:
        return
    with torch.no_grad():
        got = pre(example)
    expected = test_inputs(dataset, [0, min(1, len(dataset) - 1)])
    diff = float((got.float() - expected.float()).abs().max()) \
        if got.shape == expected.shape else float("inf")
    if diff > PREPROCESS_ATOL:
        log.warning("export: export.preprocess turns the test set's raw inputs into other "
                    "inputs than the set gives the network (max |diff| %.3g); model.onnx on raw "
                    "inputs will not score what evaluate scores", diff)


@contextlib.contextmanager
def quiet_exporter():
    """The dynamo exporter's notes about optional packages and deprecations are not ours."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        registration.setLevel(level)


def to_onnx(model: nn.Module, example: torch.Tensor, path: Path, dynamic_batch: bool,
            opset: int | None) -> str:
    """Write ``path``; returns the exporter used."""
    names = {"input_names": ["input"], "output_names": ["output"]}
    if opset is not None:
        names["opset_version"] = int(opset)
    try:
        shapes = ({0: torch.export.Dim("batch")},) if dynamic_batch else None
        with quiet_exporter():
            program = torch.onnx.export(model, (example,), dynamo=True, dynamic_shapes=shapes,
                                        verbose=False, **names)
        program.save(str(path), external_data=False)
        return "dynamo"
    except Exception as e:  # an op torch.export or onnxscript cannot take
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning("export: the dynamo exporter failed (%s); falling back to the "
                    "TorchScript-based exporter", reason)
    axes = {"input": {0: "batch"}, "output": {0: "batch"}} if dynamic_batch else None
    with quiet_exporter():
        torch.onnx.export(model, (example,), str(path), dynamo=False, dynamic_axes=axes, **names)
    return "torchscript"


def onnx_outputs(path: Path, inputs: torch.Tensor):
    """Run the graph at ``path`` in onnxruntime on the CPU."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: inputs.numpy()})[0]


def _batch_error(net: nn.Module, what: str) -> ConfigError:
    forward = f"{type(net).__module__}.{type(net).__qualname__}.forward"
    return ConfigError("export.dynamic_batch", f"is true, but {what}: the network's forward "
                       f"({forward}) likely turns the batch size into a Python number "
                       "(int(x.shape[0]), .item(), arithmetic on it); keep it symbolic "
                       "(x.flatten(1), x.reshape(x.shape[0], -1)) or set "
                       "export.dynamic_batch: false")


def check(model: Exported, path: Path, example: torch.Tensor, dynamic_batch: bool) -> float:
    """Largest |ONNX - PyTorch| on the example batch and, with ``dynamic_batch``, at batch
    sizes 1 and 3; a graph with a fixed batch, or one that fails or disagrees at another
    batch size, is an error naming ``export.dynamic_batch``."""
    from echelon3.tasks.contract import graph_io

    batches = [example]
    if dynamic_batch:
        fixed = [info["shape"][0] for info in graph_io(path) if info["shape"]
                 and isinstance(info["shape"][0], int)]
        if fixed:
            raise _batch_error(model.net, f"the graph came out with a fixed batch of "
                               f"{fixed[0]} (the example's)")
        batches += [example[:1], torch.cat([example, example[:1]])]
    worst = 0.0
    for inputs in batches:
        with torch.no_grad():
            expected = model(inputs).float().numpy()
        try:
            got = onnx_outputs(path, inputs)
        except Exception as e:
            if inputs is example:
                raise
            raise _batch_error(model.net, f"onnxruntime fails at batch size {len(inputs)} "
                               f"({str(e).strip().splitlines()[0]})") from e
        diff = float(abs(got - expected).max()) if expected.size and \
            got.shape == expected.shape else 0.0
        if got.shape != expected.shape or diff > CHECK_ATOL:
            what = f"shapes {got.shape} vs {expected.shape}, max |diff| {diff:.3g}"
            if inputs is example:
                raise RuntimeError(f"{path}: onnxruntime disagrees with PyTorch on the example "
                                   f"batch ({what})")
            raise _batch_error(model.net, f"at batch size {len(inputs)} the graph disagrees "
                               f"with PyTorch ({what})")
        worst = max(worst, diff)
    return worst


def one_output(model: Exported, example: torch.Tensor) -> None:
    """model.onnx holds one output: a network returning a mapping needs a postprocess
    that keeps one entry (:class:`echelon3.nets.heads.PickOutput`)."""
    with torch.no_grad():
        out = model(example)
    if isinstance(out, dict):
        raise ConfigError("export.postprocess", f"the network returns a mapping (keys "
                          f"{', '.join(map(str, out))}) and model.onnx holds one output; keep "
                          "one with {module: echelon3.nets.heads, type: PickOutput, config: "
                          f"{{key: {next(iter(out))}}}}}")


def save_safetensors(net: nn.Module, path: Path, source: Path) -> None:
    from safetensors.torch import save_file

    from echelon3.checkpoints.files import atomic_write, strip_prefixes

    state = {k: v.detach().cpu().contiguous().clone()
             for k, v in strip_prefixes(net.state_dict()).items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "source": str(source)})
    atomic_write(path, lambda f: f.write(tmp.read_bytes()))
    tmp.unlink()


def graph_parts(cfg, spec, config_dir) -> dict[str, Any]:
    """Everything around the network in the graph, and its example, built from the config
    (before any checkpoint is read): test set, preprocess and where it came from,
    postprocess, example batch."""
    from echelon3.config import build

    dataset = first_test_set(cfg, config_dir)
    pre, pre_from = preprocessing(spec, dataset, config_dir)
    post = build.instantiate(spec["postprocess"], "export.postprocess", config_dir) \
        if spec.get("postprocess") else None
    example = example_input(dataset, spec, raw=pre is not None)
    if pre is not None and spec.get("input") is None:
        check_preprocess(pre, dataset, example)
    return {"dataset": dataset, "pre": pre, "pre_from": pre_from, "post": post,
            "example": example}


def write_onnx(cfg, spec, net: nn.Module, parts: dict, out: Path, source: Path) -> None:
    """``out/model.onnx``, checked, with its contract in its metadata and in ``model.json``."""
    from echelon3.checkpoints.files import atomic_write, atomic_write_text
    from echelon3.tasks.contract import describe, write_metadata

    model = Exported(net, parts["pre"], parts["post"]).eval()
    example, dataset = parts["example"], parts["dataset"]
    one_output(model, example)
    tmp = out / ".model.onnx.tmp"
    try:
        exporter = to_onnx(model, example, tmp, spec["dynamic_batch"], spec.get("opset"))
        diff = check(model, tmp, example, spec["dynamic_batch"])
        contract = describe(tmp, cfg=cfg, dataset=dataset, pre=parts["pre"],
                            pre_from=parts["pre_from"], declared=declared_transform(dataset),
                            post=parts["post"], source=source, exporter=exporter)
        write_metadata(tmp, contract)
        atomic_write(out / "model.onnx", lambda f: f.write(tmp.read_bytes()))
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_text(out / "model.json", json.dumps(contract, indent=2) + "\n")
    log.info("wrote %s and model.json from %s (%s exporter; onnxruntime vs PyTorch: max |diff| "
             "%.2g at batch sizes %s)", out / "model.onnx", source, exporter, diff,
             f"{len(example)}, 1, 3" if spec["dynamic_batch"] else len(example))
    log.info("model.onnx takes %s %s %r: %s", contract["input"]["dtype"],
             contract["input"]["name"], contract["input"]["shape"], contract["input"]["is"])


def export(rc, device, launcher) -> None:
    """The CLI task: on the CPU, rank 0 only."""
    from echelon3.checkpoints.files import load, load_weights
    from echelon3.config.compose import require
    from echelon3.distributed.ranks import is_main
    from echelon3.tasks import components

    cfg = rc.cfg
    require(cfg, "net", "target", task="export")
    spec = settings(cfg)
    require_extra(spec["formats"])
    if not is_main():
        return
    parts = graph_parts(cfg, spec, rc.config_dir) if "onnx" in spec["formats"] else None
    net = components.build_net(cfg, rc.config_dir)
    source = components.build_target(cfg, rc.config_dir).for_inference(spec.get("checkpoint"))
    load_weights(net, load(source), source)
    out = Path(spec.get("output") or cfg.target.path)
    out.mkdir(parents=True, exist_ok=True)
    if "safetensors" in spec["formats"]:
        save_safetensors(net, out / "model.safetensors", source)
        log.info("wrote %s", out / "model.safetensors")
    if parts is not None:
        write_onnx(cfg, spec, net.eval(), parts, out, source)
    from echelon3.observe import mlflow

    mlflow.log_exported(rc, [out / name for name in ("model.onnx", "model.json",
                                                      "model.safetensors")])

"""``echelon3 export``: a checkpoint's network as ONNX and/or safetensors weights.

```yaml
export:
  formats: [onnx]          # onnx | safetensors (both: [onnx, safetensors])
  checkpoint: null         # default best.tar under target.path (else the newest rolling one)
  output: null             # folder for model.onnx / model.safetensors; default target.path
  preprocess: null         # {module, type, config}: raw input -> network input
  postprocess: null        # {module, type, config}: network output -> final output
  input: null              # {shape: [1, 8, 8], dtype: float32}: one raw sample; default:
                           # the first test-set inputs
  dynamic_batch: true      # the batch dimension of input and output is symbolic
  opset: null              # ONNX opset; null = the exporter's default
```

The ONNX graph is ``postprocess(net(preprocess(input)))``, so it takes raw
inputs and returns final outputs. It is written by ``torch.onnx.export(...,
dynamo=True)`` (torch.export + onnxscript, the exporter PyTorch recommends);
if that exporter cannot handle the network, the TorchScript-based one is tried
and a warning says so. The written graph is run once in onnxruntime on the
example batch and compared with PyTorch. ``onnx``, ``onnxscript``,
``onnxruntime`` and ``safetensors`` come with the optional extra
``pip install 'echelon3[export]'``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from echelon3.errors import ConfigError, UserError

log = logging.getLogger(__name__)

FORMATS = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "safetensors": ("safetensors",)}
KEYS = ("formats", "checkpoint", "output", "preprocess", "postprocess", "input",
        "dynamic_batch", "opset")
CHECK_ATOL = 1e-4  # largest |ONNX - PyTorch| accepted on the example batch (fp32)


class Standardize(nn.Module):
    """``(x * scale - mean) / std`` in float32: a typical preprocess for raw inputs."""

    def __init__(self, mean: float = 0.0, std: float = 1.0, scale: float = 1.0):
        super().__init__()
        self.mean, self.std, self.scale = float(mean), float(std), float(scale)

    def forward(self, x):
        return (x.float() * self.scale - self.mean) / self.std


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
    from echelon3.build import to_plain

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


def example_input(cfg, config_dir, spec) -> torch.Tensor:
    """A batch of two raw inputs: ``export.input``'s shape and dtype, or test-set inputs."""
    if spec is not None:
        if not isinstance(spec, dict) or not isinstance(spec.get("shape"), list):
            raise ConfigError("export.input", "must be {shape: [sizes of one sample], "
                              f"dtype: float32}}, got {spec!r}")
        dtype = getattr(torch, str(spec.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("export.input.dtype", f"not a torch dtype: {spec.get('dtype')!r}")
        return (torch.rand(2, *spec["shape"]) * 4).to(dtype)
    from echelon3 import build
    from echelon3.batches import split_batch

    _, tests, _ = build.build_datasets(cfg, config_dir, train=False)
    dataset = next(iter(tests.values()))
    batch = torch.utils.data.default_collate([dataset[0], dataset[min(1, len(dataset) - 1)]])
    inputs, _ = split_batch(batch)
    if not isinstance(inputs, torch.Tensor):
        raise ConfigError("export.input", "the test set's inputs are not one tensor; give "
                          "export.input: {shape: [...], dtype: ...}")
    return inputs


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


def check(model: nn.Module, path: Path, example: torch.Tensor) -> float:
    """Largest |ONNX - PyTorch| on the example batch; fails above ``CHECK_ATOL``."""
    with torch.no_grad():
        expected = model(example).float().numpy()
    got = onnx_outputs(path, example)
    diff = float(abs(got - expected).max()) if expected.size else 0.0
    if got.shape != expected.shape or diff > CHECK_ATOL:
        raise RuntimeError(f"{path}: onnxruntime disagrees with PyTorch on the example batch "
                           f"(shapes {got.shape} vs {expected.shape}, max |diff| {diff:.3g})")
    return diff


def save_safetensors(net: nn.Module, path: Path, source: Path) -> None:
    from safetensors.torch import save_file

    from echelon3.checkpoint import atomic_write, strip_prefixes

    state = {k: v.detach().cpu().contiguous().clone()
             for k, v in strip_prefixes(net.state_dict()).items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "source": str(source)})
    atomic_write(path, lambda f: f.write(tmp.read_bytes()))
    tmp.unlink()


def export(rc, device, launcher) -> None:
    """The CLI task: on the CPU, rank 0 only."""
    from echelon3 import build
    from echelon3.checkpoint import atomic_write, load, load_weights
    from echelon3.config import require
    from echelon3.dist import is_main

    cfg = rc.cfg
    require(cfg, "net", "target", task="export")
    spec = settings(cfg)
    require_extra(spec["formats"])
    if not is_main():
        return
    pre = build.instantiate(spec["preprocess"], "export.preprocess", rc.config_dir) \
        if spec.get("preprocess") else None
    post = build.instantiate(spec["postprocess"], "export.postprocess", rc.config_dir) \
        if spec.get("postprocess") else None
    example = example_input(cfg, rc.config_dir, spec.get("input"))
    net = build.build_net(cfg, rc.config_dir)
    source = build.build_target(cfg, rc.config_dir).for_inference(spec.get("checkpoint"))
    load_weights(net, load(source), source)
    model = Exported(net, pre, post).eval()
    out = Path(spec.get("output") or cfg.target.path)
    out.mkdir(parents=True, exist_ok=True)
    if "safetensors" in spec["formats"]:
        save_safetensors(net, out / "model.safetensors", source)
        log.info("wrote %s", out / "model.safetensors")
    if "onnx" in spec["formats"]:
        tmp = out / ".model.onnx.tmp"
        exporter = to_onnx(model, example, tmp, spec["dynamic_batch"], spec.get("opset"))
        diff = check(model, tmp, example)
        atomic_write(out / "model.onnx", lambda f: f.write(tmp.read_bytes()))
        tmp.unlink()
        log.info("wrote %s from %s (%s exporter; onnxruntime vs PyTorch on the example: "
                 "max |diff| %.2g)", out / "model.onnx", source, exporter, diff)

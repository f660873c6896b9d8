"""The Python API: a trained run as a network, and its outputs on new inputs.

```python
import echelon3

model = echelon3.load("results/digits_mlp")      # best.tar's weights, in eval mode
outputs = echelon3.predict("results/digits_mlp", inputs)
```

:func:`load` reads the run folder's ``config.yaml`` (the resolved config the run trained
with) and builds what ``echelon3 export`` puts in ``model.onnx``, as a PyTorch module:
``postprocess(net(preprocess(x)))``, with ``export.preprocess`` (a component, or
``dataset``: the test set's own declared transform) and ``export.postprocess`` from that
config, each the identity when not set. So :func:`predict` takes what ``model.onnx``
takes (``model.json``'s ``input.is``): raw inputs when a preprocess is fused, else the
network's inputs as the test set gives them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from echelon3.config.errors import UserError

CONFIG = "config.yaml"  # what every trained run folder holds (tasks/identity.py)


class Model(nn.Module):
    """A run's network with its preprocessing, in eval mode: ``model(x)`` is
    ``postprocess(net(preprocess(x)))``, under the config's root ``precision``.

    ``net``, ``preprocess`` and ``postprocess`` are the parts; ``checkpoint`` the file the
    weights came from; ``config`` the run's resolved config; ``precision`` the
    :class:`~echelon3.distributed.precision.Precision` its inference tasks use."""

    def __init__(self, exported: nn.Module, checkpoint: Path, config, precision, device):
        super().__init__()
        self.net, self.preprocess, self.postprocess = (exported.net, exported.preprocess,
                                                       exported.postprocess)
        self.checkpoint, self.config, self.precision = checkpoint, config, precision
        self.device = torch.device(device)

    def forward(self, x):
        return self.postprocess(self.net(self.preprocess(x)))


def _config(run_dir: Path):
    path = run_dir / CONFIG
    if not path.is_file():
        raise UserError(str(path), "not found: a trained run folder holds the config.yaml its "
                        "training wrote (is this a run's target.path?)")
    cfg = OmegaConf.load(path)
    cfg.pop("_versions", None)
    cfg.target.path = str(run_dir)  # the folder where it lies now, wherever it trained
    return cfg


def load(run_dir: str | Path, checkpoint: str | None = None, device: str = "cpu",
         config_dir: str | Path | None = None) -> Model:
    """The network of the run in ``run_dir`` with ``best.tar``'s weights (or
    ``checkpoint``'s: a file name there or a path; without best.tar, the newest rolling
    checkpoint), in eval mode, with the preprocessing ``echelon3 export`` fuses.

    ``config_dir``: where the config's own module files (``module: my_net.py``) are found
    when they are not in the current folder."""
    from echelon3.checkpoints.files import load as load_checkpoint
    from echelon3.checkpoints.files import load_weights
    from echelon3.config.build import instantiate
    from echelon3.distributed.precision import Precision
    from echelon3.tasks import components
    from echelon3.tasks.export import FROM_DATASET, Exported, first_test_set, preprocessing, \
        settings

    run_dir = Path(run_dir)
    folder = Path(config_dir) if config_dir is not None else None
    cfg = _config(run_dir)
    spec = settings(cfg)
    dataset = first_test_set(cfg, folder) if spec.get("preprocess") == FROM_DATASET else None
    pre, _ = preprocessing(spec, dataset, folder)
    post = instantiate(spec["postprocess"], "export.postprocess", folder) \
        if spec.get("postprocess") else None
    net = components.build_net(cfg, folder)
    path = components.build_target(cfg, folder).for_inference(checkpoint)
    load_weights(net, load_checkpoint(path), path)
    exported = Exported(net, pre, post)
    precision = Precision.from_config(torch.device(device), cfg.get("precision"),
                                      key="precision")
    return Model(exported, path, cfg, precision, device).to(device).eval()


def _batch(inputs) -> torch.Tensor:
    """A tensor, an array, or a sequence of samples (tensors or arrays): one batch."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, list | tuple) and inputs and not isinstance(inputs[0], int | float):
        return torch.stack([torch.as_tensor(x) for x in inputs])
    return torch.as_tensor(inputs)


@torch.no_grad()
def predict(run: str | Path | Model, inputs, checkpoint: str | None = None,
            device: str = "cpu", batch_size: int | None = None):
    """The outputs of the run's network (see :func:`load`) on ``inputs``: a batch (a
    tensor or an array) or a sequence of samples. ``run``: a run folder, or a model
    :func:`load` gave (load once, predict many times). ``batch_size``: run the batch in
    pieces of that size (default: all at once). Outputs are on the CPU."""
    model = run if isinstance(run, Model) else load(run, checkpoint, device)
    batch = _batch(inputs)
    size = batch_size or max(len(batch), 1)
    outs = []
    for start in range(0, max(len(batch), 1), size):
        with model.precision.autocast():
            out = model(batch[start:start + size].to(model.device))
        outs.append(out)
    if isinstance(outs[0], dict):
        return {k: torch.cat([_cpu(o[k]) for o in outs]) for k in outs[0]}
    return torch.cat([_cpu(o) for o in outs])


def _cpu(out: torch.Tensor) -> torch.Tensor:
    """On the CPU; half-precision outputs (autocast) as float32."""
    return (out.float() if out.is_floating_point() else out).cpu()


__all__ = ["Model", "load", "predict"]

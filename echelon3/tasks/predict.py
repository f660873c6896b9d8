"""``echelon3 predict``: score the exported ``model.onnx`` on the test set(s), as a user
of the file would run it, with the metrics ``evaluate`` computes for the checkpoint.

The graph runs in onnxruntime on the CPU. When it fuses a preprocess (``model.json``
says so), it is fed the test set's raw inputs (its ``raw_input(index)``), not the
transformed ones, so the scores show whether the exported file on raw data does what
``evaluate`` reported. Results go to ``model.metrics.json`` beside ``model.onnx``,
and each metric is logged next to evaluate's (``metrics.json``) when there is one. A graph
that keeps one entry of a network's mapping output (``output_key`` in ``model.json``)
gives its output under that key, so metrics with ``input_key`` read it as in ``evaluate``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from echelon3.checkpoints.files import atomic_write_text
from echelon3.config.errors import UserError
from echelon3.distributed.ranks import is_main

log = logging.getLogger(__name__)


class OnnxNet(nn.Module):
    """An ONNX graph behind the ``nn.Module`` call the evaluation loop makes."""

    def __init__(self, path: Path, output_key: str | None = None):
        super().__init__()
        self.output_key = output_key  # the graph's output is this entry of the network's
        import onnxruntime

        self.session = onnxruntime.InferenceSession(str(path),
                                                    providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input_name: x.detach().cpu().numpy()})[0]
        out = torch.from_numpy(out).to(x.device)
        return out if self.output_key is None else {self.output_key: out}


class RawInputs(Dataset):
    """``(raw_input(i), target)`` of a dataset that declares its raw inputs."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        from echelon3.data.batches import split_batch

        _, target = split_batch(self.dataset[index])
        return self.dataset.raw_input(index), target


def graph_inputs(sets: dict, contract: dict, path: Path) -> dict:
    """The test sets as the graph wants them: raw when it fuses a preprocess."""
    if not contract.get("preprocess"):
        return sets
    out = {}
    for name, dataset in sets.items():
        if hasattr(dataset, "raw_input"):
            out[name] = RawInputs(dataset)
        elif getattr(dataset, "preprocess", None) is not None:
            raise UserError(f"data.test{'' if name == 'test' else '.' + name}",
                            f"{type(dataset).__name__} declares a preprocess but no "
                            f"raw_input(index), so it cannot feed {path} (which fuses a "
                            "preprocess) raw inputs")
        else:
            out[name] = dataset  # the set's inputs are raw already
    return out


def predict(rc, device, launcher) -> None:
    from echelon3.config.compose import require
    from echelon3.data.loaders import create_dataloaders
    from echelon3.distributed.precision import Precision
    from echelon3.tasks import components
    from echelon3.tasks.export import require_extra, settings
    from echelon3.trainers.evaluation import evaluate_sets

    cfg = rc.cfg
    require(cfg, "data", "dataloaders", "metrics", "target", task="predict")
    require_extra(["onnx"])
    folder = Path(settings(cfg).get("output") or cfg.target.path)
    path = folder / "model.onnx"
    if not path.is_file():
        raise UserError(str(path), "not found; write it first with echelon3 export (same "
                        "config)")
    contract_file = folder / "model.json"
    contract = json.loads(contract_file.read_text()) if contract_file.is_file() else {}
    if not contract:
        log.warning("predict: no %s; feeding the test set's inputs as they are", contract_file)
    cpu = torch.device("cpu")
    metrics = components.build_metrics(cfg, rc.config_dir, device=cpu)
    _, tests, named = components.build_datasets(cfg, rc.config_dir, train=False)
    _, loaders = create_dataloaders(cfg.dataloaders, None, graph_inputs(tests, contract, path),
                                    rank=launcher.rank, world_size=launcher.world_size,
                                    seed=cfg.get("seed", 0), config_dir=rc.config_dir)
    net = OnnxNet(path, contract.get("output_key"))
    results = evaluate_sets(net, loaders, metrics, named_sets=named, device=cpu,
                            precision=Precision.from_config(cpu, "fp32", key="precision"))
    if is_main():
        output = folder / "model.metrics.json"
        atomic_write_text(output, json.dumps(results, indent=2, sort_keys=True) + "\n")
        evaluated = Path(cfg.target.path) / "metrics.json"
        checkpoint = json.loads(evaluated.read_text()) if evaluated.is_file() else {}
        width = max((len(k) for k in results), default=6)
        table = "\n".join(f"  {k:<{width}}  {v:.4f}" + (
            f"  (evaluate: {checkpoint[k]:.4f})" if k in checkpoint else "")
            for k, v in results.items())
        log.info("%s on the test set (written to %s):\n%s", path, output, table)

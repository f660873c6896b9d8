"""``echelon3 run``: inference with a checkpoint, one CSV row per sample (the built-in
:class:`Runner`; a runner whose ``reads_data`` is false is handed the network alone, e.g.
:class:`echelon3.tasks.generate.TextGenerator`).

Columns: ``index`` (position in its data set), ``set`` (only with named test
sets), ``prediction`` (the arg-max class for classifier outputs, the value
otherwise) and ``score_<k>`` (class probabilities for classifiers). Under DDP
each rank infers its shard and rank 0 gathers and writes the rows in order.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from echelon3.checkpoints.files import atomic_write_text
from echelon3.config.errors import UserError
from echelon3.data.batches import split_batch, to_device
from echelon3.distributed.ranks import all_gather_object, is_main

log = logging.getLogger(__name__)


def _inputs(batch: Any):
    """Batches may carry labels or not; inference only needs the input."""
    try:
        return split_batch(batch)[0]
    except TypeError:
        return batch


class Runner:
    """The built-in ``runner``: injects ``path=`` (target.path).

    ``checkpoint``: file to load (default best.tar, else the newest rolling one);
    ``output``: the CSV (default ``<target.path>/predictions.csv``);
    ``data``: a dataset triple to predict on (default: the test set(s));
    ``output_key``: the entry written, for a network that returns a mapping of outputs.
    """

    lazy_specs = ("data",)  # built by the task, like the other data sets

    def __init__(self, path: str, checkpoint: str | None = None, output: str | None = None,
                 data: Mapping | None = None, output_key: str | None = None):
        self.path = Path(path)
        self.checkpoint = checkpoint
        self.output = Path(output) if output else self.path / "predictions.csv"
        self.data = data
        self.output_key = output_key

    @torch.no_grad()
    def __call__(self, *, net, loaders: Mapping, precision, device, named_sets: bool) -> int:
        rows = []
        for set_name, loader in loaders.items():
            order = iter(loader.sampler)
            for batch in loader:
                with precision.autocast():
                    out = self.pick(net(to_device(_inputs(batch), device))).float().cpu()
                for pred in out:
                    rows.append((set_name, next(order), pred))
        rows = [row for part in all_gather_object(rows) for row in part]
        if is_main():
            set_rank = {name: i for i, name in enumerate(loaders)}
            self.write(sorted(rows, key=lambda r: (set_rank[r[0]], r[1])), named_sets)
        return len(rows)

    def pick(self, out):
        """The output written: the ``output_key`` entry of a mapping, else ``out``."""
        from echelon3.data.batches import pick

        if isinstance(out, Mapping) and self.output_key is None:
            raise UserError("runner.output_key", f"the network returns a mapping (keys "
                            f"{', '.join(map(str, out))}); name the entry to write")
        return pick(out, self.output_key, "runner.output_key", "network output")

    def write(self, rows: list, named_sets: bool) -> None:
        width = max((r[2].numel() for r in rows), default=1)
        classifier = width > 1
        header = ["index", *(["set"] if named_sets else []), "prediction"]
        header += [f"score_{k}" for k in range(width)] if classifier else []
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(header)
        for set_name, index, pred in rows:
            pred = pred.flatten()
            row: list[Any] = [index, *([set_name] if named_sets else [])]
            if classifier:
                probs = torch.softmax(pred, dim=0)
                row += [int(pred.argmax()), *(f"{p:.6g}" for p in probs.tolist())]
            else:
                row.append(f"{pred.item():.6g}")
            writer.writerow(row)
        atomic_write_text(self.output, buffer.getvalue())
        log.info("wrote %d predictions to %s", len(rows), self.output)


def run(rc, device, launcher) -> None:
    from echelon3.config import build
    from echelon3.config.compose import require
    from echelon3.data.loaders import create_dataloaders
    from echelon3.data.rng import seed_everything
    from echelon3.tasks import components
    from echelon3.tasks.inference import load_for_inference

    cfg = rc.cfg
    require(cfg, "net", "target", task="run")
    seed_everything(int(cfg.get("seed", 0)))
    spec = build.with_default_type(cfg.get("runner"), "runner", "echelon3.tasks.run", "Runner")
    runner = build.instantiate(spec, "runner", rc.config_dir, path=cfg.target.path)
    if not getattr(runner, "reads_data", True):  # e.g. echelon3.tasks.generate's text
        net, precision = load_for_inference(rc, device, getattr(runner, "checkpoint", None))
        runner(net=net, precision=precision, device=device)
        return
    require(cfg, "dataloaders", task="run")
    data = getattr(runner, "data", None)
    if data is not None:
        sets, named = {"run": build.instantiate(data, "runner.config.data", rc.config_dir)}, False
    else:
        require(cfg, "data", task="run")
        _, sets, named = components.build_datasets(cfg, rc.config_dir, train=False)
    loaders_cfg = cfg.dataloaders
    if data is not None and "run" not in loaders_cfg:
        loaders_cfg = {**loaders_cfg, "run": loaders_cfg.get("test")}
    _, loaders = create_dataloaders(loaders_cfg, None, sets, rank=launcher.rank,
                                    world_size=launcher.world_size, seed=cfg.get("seed", 0),
                                    config_dir=rc.config_dir,
                                    data_keys={"run": "runner.config.data"} if data else None)
    net, precision = load_for_inference(rc, device, getattr(runner, "checkpoint", None))
    runner(net=net, loaders=loaders, precision=precision, device=device, named_sets=named)

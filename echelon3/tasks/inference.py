"""Set-up shared by the train / evaluate / run tasks, and the ``finetune`` task."""

from __future__ import annotations

import logging

from echelon3 import build
from echelon3.checkpoint import CheckpointManager, load, load_weights
from echelon3.precision import Precision

log = logging.getLogger(__name__)


def load_for_inference(rc, device, checkpoint: str | None):
    """The network with a checkpoint's weights, in eval mode, and the root ``precision``.

    The network and precision are built from the config first, so a config
    mistake is reported as such before any checkpoint is read.
    """
    cfg = rc.cfg
    manager: CheckpointManager = build.build_target(cfg, rc.config_dir)
    net = build.build_net(cfg, rc.config_dir)
    precision = Precision.from_config(device, cfg.get("precision"), key="precision")
    path = manager.for_inference(checkpoint)
    state = load(path)
    load_weights(net, state, path)
    net.to(device).eval()
    log.info("loaded %s (epoch %s); precision %s", path, state.get("epoch"), precision.describe())
    return net, precision


def finetune(rc, device, launcher) -> None:
    """``echelon3 finetune``: ``train`` started from ``init_from``'s weights (required here)."""
    from echelon3.config import require
    from echelon3.train import train

    require(rc.cfg, "init_from", task="finetune")
    train(rc, device, launcher)

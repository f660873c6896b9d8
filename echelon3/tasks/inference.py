"""A trained network for the inference tasks (evaluate, run): weights from a checkpoint,
in eval mode, with the root ``precision``."""

from __future__ import annotations

import logging

from echelon3.checkpoints.files import CheckpointManager, load, load_weights
from echelon3.distributed.precision import Precision
from echelon3.tasks import components

log = logging.getLogger(__name__)


def load_for_inference(rc, device, checkpoint: str | None):
    """The network with a checkpoint's weights, in eval mode, and the root ``precision``.

    The network and precision are built from the config first, so a config
    mistake is reported as such before any checkpoint is read.
    """
    cfg = rc.cfg
    manager: CheckpointManager = components.build_target(cfg, rc.config_dir)
    net = components.build_net(cfg, rc.config_dir)
    precision = Precision.from_config(device, cfg.get("precision"), key="precision")
    path = manager.for_inference(checkpoint)
    state = load(path)
    load_weights(net, state, path)
    net.to(device).eval()
    log.info("loaded %s (epoch %s); precision %s", path, state.get("epoch"), precision.describe())
    return net, precision


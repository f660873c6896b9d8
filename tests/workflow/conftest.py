"""One trained workflow shared by every test that reads a finished run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.workflow.helpers import REPO, RUN_S, copy_workflow, snakemake

EPOCHS = 3
EARLY = "digits_mlp"  # the experiment early stopping ends after epoch 2


@pytest.fixture(scope="session")
def finished(tmp_path_factory) -> Path:
    """The shipped workflow, the digits experiments cut to EPOCHS epochs, run with
    plain `snakemake -j1`; what it printed is in console.txt. Read-only: tests
    that change it work on a copy (helpers.copy_finished)."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    for spec in config["experiments"].values():
        spec["overrides"] = [f"trainer.config.epochs={EPOCHS}"]
    # digits_mlp stops early after epoch 2 of 3 (nothing improves by 1.0): a finished
    # run for the workflow, whose outputs the rest of the workflow takes as they are.
    config["experiments"][EARLY]["overrides"] += [
        "trainer.config.early_stopping.patience=1", "trainer.config.early_stopping.min_delta=1.0"]
    wf = copy_workflow(tmp_path_factory.mktemp("finished"), config)
    (wf / "console.txt").write_text(snakemake(wf, "-j1", timeout=RUN_S))
    return wf

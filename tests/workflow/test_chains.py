"""Experiments that start from another one (`init_from`) and exported models
(`export`): DAG edges, reruns, refused cycles, and the default's chain."""

from __future__ import annotations

import csv
import re

import pytest

from tests.workflow.helpers import (CHAIN, copy_finished, copy_workflow, experiment, failing,
                                    jobs_for, jobs_listed, planned, shell_commands, snakemake)


def job_body(output: str, rule: str, exp: str) -> str:
    for name, body in jobs_listed(output):
        if name == rule and re.search(rf"wildcards: exp={re.escape(exp)}\b", body):
            return body
    raise AssertionError(f"no {rule} job for {exp} in:\n{output[-3000:]}")


def test_finetuned_sweep_and_exports_depend_on_their_parent(tmp_path):
    wf = copy_workflow(tmp_path, {
        "experiments": {"base": experiment("digits_mlp")},
        "sweeps": {"ft": {"config": "digits_mlp_ft", "init_from": "base",
                          "export": ["onnx", "safetensors"],
                          "grid": {"optimizer.config.lr": [0.01, 0.02]}}}})
    out = snakemake(wf, "-n", "-p")
    points = ["ft/lr~0.01", "ft/lr~0.02"]
    assert planned(out) == jobs_for("base") | {
        (rule, p) for p in points for rule in ("finetune", "evaluate", "run", "export")}
    for point in points:
        body = job_body(out, "finetune", point)
        assert re.search(r"input: .*results/base/best\.tar", body), body
        (command,) = [c for c in shell_commands(out)
                      if c.startswith(f"ECHELON3_EXPERIMENT='{point}' ECHELON3_SWEEP=ft "
                                      "echelon3 train") and f"results/{point}'" in c]
        assert "init_from.checkpoint=results/base/best.tar" in command
        exports = [b for name, b in jobs_listed(out) if name == "export" and point in b]
        assert {re.search(r"output: (\S+)", b).group(1) for b in exports} == {
            f"results/{point}/model.onnx", f"results/{point}/model.safetensors"}


@pytest.mark.parametrize("experiments, message", [
    ({"a": {"config": "digits_mlp_ft", "init_from": "b"},
      "b": {"config": "digits_mlp_ft", "init_from": "c"},
      "c": {"config": "digits_mlp_ft", "init_from": "a"}},
     "config/config.yaml: init_from makes a cycle: a -> b -> c -> a"),
    ({"a": {"config": "digits_mlp_ft", "init_from": "a"}}, "init_from makes a cycle: a -> a"),
    ({"a": {"config": "digits_mlp_ft", "init_from": "nope"}},
     "config/config.yaml: experiments.a.init_from: no experiment named 'nope'"),
])
def test_init_from_cycles_and_unknown_parents_are_refused(tmp_path, experiments, message):
    wf = copy_workflow(tmp_path, {"experiments": experiments})
    assert message in failing(wf, "-n").stdout


def test_default_chain_finetunes_after_its_parent_and_exports(finished):
    parent = finished / "results/digits_mlp/best.tar"
    child = finished / "results/digits_mlp_ft"
    log = (finished / "logs/train/digits_mlp_ft.log").read_text()
    assert "init_from results/digits_mlp/best.tar: loaded 4 tensors, skipped 0, missing 0" in log
    assert "finetune: 8320 of 9610 parameter values frozen" in log  # layers.1: 64x128 + 128
    assert parent.stat().st_mtime < (child / "config.yaml").stat().st_mtime  # DAG order
    onnxruntime = pytest.importorskip("onnxruntime", reason="needs the 'export' extra")
    import numpy as np

    session = onnxruntime.InferenceSession(str(child / "model.onnx"))
    probabilities = session.run(None, {session.get_inputs()[0].name:
                                       np.zeros((3, 1, 8, 8), np.float32)})[0]
    assert probabilities.shape == (3, 10) and abs(probabilities.sum(1) - 1).max() < 1e-5
    with open(finished / "results/leaderboard.csv") as f:
        models = {r["experiment"]: r["model"] for r in csv.DictReader(f)}
    assert models == {"digits_cnn": "", "digits_mlp": "",
                      "digits_mlp_ft": "results/digits_mlp_ft/model.onnx"}
    assert "[model.onnx](digits_mlp_ft/model.onnx)" in (
        finished / "results/leaderboard.md").read_text()
    assert '<a href="digits_mlp_ft/model.onnx">model.onnx</a>' in (
        finished / "results/leaderboard.html").read_text()


def test_new_parent_weights_rerun_its_child(finished, tmp_path):
    """As a retrained parent leaves it: best.tar with other weights (a touch alone is not
    enough: Snakemake compares the checksum of a small input whose mtime changed)."""
    import torch

    wf = copy_finished(finished, tmp_path / "wf")
    best = wf / "results/digits_mlp/best.tar"
    state = torch.load(best, weights_only=True)
    state["model_state_dict"] = {k: v + 0.01 for k, v in state["model_state_dict"].items()}
    best.unlink()
    torch.save(state, best)
    out = snakemake(wf, "-n")
    parent_downstream = {("evaluate", "digits_mlp"), ("run", "digits_mlp")}  # not its train
    assert planned(out) == CHAIN | parent_downstream | {("report", None), ("all", None)}

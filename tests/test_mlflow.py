"""MLflow tracking against a real MLflow server started here (sqlite store, local
artifact root): a 2-rank run preempted and resumed, a sweep of 3 through
``snakemake -j1`` with its evaluate jobs, a server that is down, and a resumed run that
sends no step twice. Each run is read back through ``MlflowClient`` and compared with its
``history.jsonl``, value for value. The default local store (``./mlflow.db``) is the
example of docs/tracking.md, which tests/test_docs_examples.py runs and checks the same
way."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from echelon3 import __version__ as echelon3_version
from echelon3.distributed import preemption
from echelon3.observe.loggers import JsonlLogger
from echelon3.observe.mlflow import STATE, Settings, Tracker
from tests.conftest import BIN, probe_config, run_cli
from tests.helpers import echelon3, write_config
from tests.workflow.helpers import RUN_S, copy_workflow, env_with, snakemake

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra: pip install -e '.[mlflow]'")
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import ViewType  # noqa: E402

HERE = Path(__file__).resolve().parent
START_S = 120  # the server's start, generous for a loaded 2-core machine
RECORD_KEYS = ("split", "epoch", "step")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on a free localhost port: its URI, for every test of the module."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{folder}/db.sqlite",
         "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"mlflow server did not start:\n{(folder / 'server.log').read_text()}")
        time.sleep(0.25)
    yield uri
    os.killpg(proc.pid, signal.SIGKILL)  # its store is thrown away with the folder
    proc.wait()
    log.close()


def expected_metrics(history: Path) -> dict[str, list[tuple[int, float]]]:
    """``split/name -> [(step, value), ...]`` from history.jsonl, computed independently of
    the tracker."""
    points: dict[str, list[tuple[int, float]]] = {}
    for line in history.read_text().splitlines():
        record = json.loads(line)
        for name, value in record.items():
            if name in RECORD_KEYS or isinstance(value, bool) or \
                    not isinstance(value, int | float):
                continue
            points.setdefault(f"{record['split']}/{name}", []).append(
                (record["step"], float(value)))
    return points


def assert_mirrors_history(client: MlflowClient, run_id: str, folder: Path) -> None:
    """Every train, validation and time metric of MLflow's run equals history.jsonl, point
    for point (no step missing, none twice)."""
    expected = expected_metrics(folder / "history.jsonl")
    run = client.get_run(run_id)
    logged = {k for k in run.data.metrics if k.split("/")[0] in ("train", "val", "time")}
    assert logged == set(expected)
    for key, points in expected.items():
        got = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        assert sorted(got) == sorted(points), key


def state(folder: Path) -> dict:
    return json.loads((folder / STATE).read_text())


# --------------------------------------------------------------------------- runs

def _tracked(folder: Path, server: str, experiment: str, log_models: bool = False,
             **net) -> None:
    """The probe run (tests/conftest.py), tracked on ``server``."""
    probe_config(folder, epochs=2, extra={
        **({"net": {"module": str(HERE / "preempting.py"), "type": "PreemptingNet",
                    "config": net}} if net else {}),
        "trainer": {"config": {"epochs": 2, "precision": "fp32", "log_every_n_steps": 1,
                               "progress_bar": False}},
        "target": {"path": str(folder / "run")},
        "mlops": {"config": {"tensorboard": False}},
        "mlflow": {"tracking_uri": server, "experiment": experiment,
                   "log_models": log_models}})


def test_two_ranks_log_once_from_rank_0(tmp_path, server):
    _tracked(tmp_path, server, "two-ranks")
    done = run_cli(["train", "-cd", str(tmp_path), "-cn", "probe", "nproc=2"], timeout=RUN_S)
    assert done.returncode == 0, done.stderr
    folder, client = tmp_path / "run", MlflowClient(server)
    experiment = client.get_experiment_by_name("two-ranks")
    (run,) = client.search_runs([experiment.experiment_id])  # one run, not one per rank
    assert run.info.run_id == state(folder)["run_id"]
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2" and run.data.tags["precision"]
    assert run.data.tags["echelon3.version"] == echelon3_version
    assert run.data.params["dataloaders.train.config.batch_size"] == "8"
    assert run.data.params["loss.0.ce.module"] == "torch.nn"
    assert_mirrors_history(client, run.info.run_id, folder)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["mlflow"]["logged"] is True
    assert summary["mlflow"]["run_id"] == run.info.run_id
    assert run.data.metrics["best/accuracy"] == summary["best"]["metrics"]["accuracy"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {
        "config.yaml", "history.jsonl", "summary.json"}


def test_a_preempted_run_resumes_into_the_same_mlflow_run(tmp_path, server, own_handlers):
    _tracked(tmp_path, server, "preempted", log_models=True,
             marker=str(tmp_path / "preempted"), at=5)
    assert echelon3("train", tmp_path, name="probe") == preemption.RESUBMIT_EXIT
    folder, client = tmp_path / "run", MlflowClient(server)
    run_id = state(folder)["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    stopped_at = max(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert 0 < stopped_at < 16  # part-way: 8 steps an epoch, 2 epochs
    preemption.reset()
    assert echelon3("train", tmp_path, name="probe") == 0
    assert state(folder)["run_id"] == run_id
    experiment = client.get_experiment_by_name("preempted")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_mirrors_history(client, run_id, folder)  # every step once, the resumed ones too
    copy = client.download_artifacts(run_id, "best.tar", str(tmp_path))  # log_models: true
    assert Path(copy).read_bytes() == (folder / "best.tar").read_bytes()
    # another config in the same folder is refused (on_config_change: error): no new run
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.5", name="probe") == 2
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_a_run_that_fails_before_its_first_checkpoint_leaves_no_mlflow_run(tmp_path, server):
    probe_config(tmp_path, epochs=1, extra={
        "net": {"module": str(HERE / "probe.py"), "type": "ProbeNet",
                "config": {"fail_on_rank": 0, "fail_at_step": 4}},
        "trainer": {"config": {"epochs": 1, "log_every_n_steps": 1, "progress_bar": False}},
        "target": {"path": str(tmp_path / "run")},
        "mlops": {"config": {"tensorboard": False}},
        "mlflow": {"tracking_uri": server, "experiment": "failed"}})
    assert echelon3("train", tmp_path, name="probe") == 1  # the net's error, named
    # the run's files were taken back (only the lock's own file may stay), mlflow.json too
    assert [p.name for p in (tmp_path / "run").iterdir()] in ([], [".echelon3.lock"])
    client = MlflowClient(server)
    experiment = client.get_experiment_by_name("failed")
    (deleted,) = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
    assert deleted.info.lifecycle_stage == "deleted"
    assert client.get_metric_history(deleted.info.run_id, "train/loss")  # it had begun


def test_a_resumed_run_sends_no_step_it_already_sent(tmp_path, server):
    """After a hard kill the run resumes from an earlier checkpoint and logs steps again:
    MLflow keeps one point per step, the first attempt's."""
    settings = Settings(server, "resume", "r", False)

    def attempt(resumed, records, rewind=None):
        tracker = Tracker(settings, tmp_path)
        logger = tracker.watch(JsonlLogger(tmp_path / "history.jsonl"), resumed=resumed)
        if rewind is not None:
            logger.rewind(rewind)
        for record in records:
            logger.log(record)
        logger.close()
        return tracker.run_id

    first = attempt(False, [{"split": "train", "epoch": 1, "step": s, "loss": 10.0 + s}
                            for s in range(1, 7)])
    again = attempt(True, [{"split": "train", "epoch": 1, "step": s, "loss": 20.0 + s}
                           for s in range(4, 10)], rewind=3)
    assert again == first
    points = [(m.step, m.value) for m in MlflowClient(server).get_metric_history(first,
                                                                                 "train/loss")]
    assert sorted(points) == [(s, 10.0 + s) for s in range(1, 7)] + \
        [(s, 20.0 + s) for s in range(7, 10)]



def test_tracking_turned_on_later_backfills_what_mlflow_never_got(tmp_path, server):
    """A run trained without MLflow, then tracked: the attempt that finds it finished (and
    trains nothing) sends its whole history; one that trains on sends the rest as well."""
    history = JsonlLogger(tmp_path / "history.jsonl")
    for step in range(1, 7):
        history.log({"split": "train", "epoch": 1 + (step > 3), "step": step, "loss": 1 / step})
        if step % 3 == 0:
            history.log({"split": "val", "epoch": step // 3, "step": step, "accuracy": step / 10})
    history.close()
    tracker = Tracker(Settings(server, "backfill", "finished", False), tmp_path)
    tracker.finish({"best": {"step": 6, "metrics": {"accuracy": 0.6}}})
    client = MlflowClient(server)
    assert_mirrors_history(client, tracker.run_id, tmp_path)
    (tmp_path / STATE).unlink()  # a new MLflow run, which resumes the training:
    later = Tracker(Settings(server, "backfill", "resumed", False), tmp_path)
    logger = later.watch(JsonlLogger(tmp_path / "history.jsonl"), resumed=True)
    for step in (7, 8, 9):
        logger.log({"split": "train", "epoch": 3, "step": step, "loss": 1 / step})
    logger.close()
    later.finish({"best": {"step": 6, "metrics": {"accuracy": 0.6}}})
    assert later.run_id != tracker.run_id
    assert_mirrors_history(client, later.run_id, tmp_path)

# --------------------------------------------------------------------------- the workflow

def test_a_sweep_of_three_shares_one_experiment_and_the_leaderboard_links_it(tmp_path, server):
    lrs = (0.1, 0.05, 0.01)
    wf = copy_workflow(tmp_path, {"experiments": {}, "sweeps": {"lr": {
        "config": "tiny", "grid": {"optimizer.config.lr": list(lrs)},
        "resources": {"gpus": 0, "cpus": 1}}}})
    probe_config(wf / "config/experiments", "tiny", epochs=1, extra={  # no scikit-learn
        "mlops": {"config": {"tensorboard": False}}, "mlflow": {"tracking_uri": server}})
    env = env_with()
    env.pop("MLFLOW_TRACKING_URI", None)
    snakemake(wf, "-j1", "results/leaderboard.csv", timeout=RUN_S, env=env)
    client = MlflowClient(server)
    experiment = client.get_experiment_by_name("lr")  # the sweep's name
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    names = [f"lr/lr~{lr}" for lr in lrs]
    assert sorted(runs) == sorted(names)
    table = {row["experiment"]: row for row in
             pd.read_csv(wf / "results/leaderboard.csv").to_dict("records")}
    for name in names:
        run, folder = runs[name], wf / "results" / name
        assert run.info.run_id == state(folder)["run_id"]
        assert run.data.tags["snakemake.experiment"] == name
        assert run.data.tags["snakemake.sweep"] == "lr"
        assert run.data.params["optimizer.config.lr"] == name.split("~")[1]
        assert_mirrors_history(client, run.info.run_id, folder)
        # evaluate: metrics.json's numbers in the training run, at best.tar's step
        tested = json.loads((folder / "metrics.json").read_text())
        step = json.loads((folder / "summary.json").read_text())["best"]["step"]
        assert [(m.step, m.value) for m in client.get_metric_history(
            run.info.run_id, "test/accuracy")] == [(step, tested["accuracy"])]
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert "metrics.json" in artifacts and "curves" in artifacts
        assert table[name]["mlflow"] == (f"{server}/#/experiments/{experiment.experiment_id}"
                                         f"/runs/{run.info.run_id}")
    assert f"[run]({server}/#/experiments/" in (wf / "results/leaderboard.md").read_text()


# --------------------------------------------------------------------------- no server

def test_a_server_that_is_down_warns_once_and_the_run_finishes(tmp_path, monkeypatch, caplog,
                                                               own_handlers):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    write_config(tmp_path, {"mlflow": {"tracking_uri": down}})
    with caplog.at_level(logging.WARNING, logger="echelon3.observe.mlflow"):
        assert echelon3("train", tmp_path) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "echelon3.observe.mlflow"]
    assert len(warnings) == 1 and f"MLflow tracking at {down} is off" in warnings[0]
    folder = tmp_path / "out"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["mlflow"]["logged"] is False
    assert summary["mlflow"]["error"].startswith("starting the run: ")
    assert summary["epochs"] == 2 and (folder / "best.tar").is_file()
    assert {r["epoch"] for r in map(json.loads, (folder / "history.jsonl").read_text()
                                    .splitlines())} == {1, 2}


def test_a_bad_mlflow_key_is_one_line_naming_it(tmp_path, capsys):
    write_config(tmp_path, {"mlflow": {"experiment": "x", "log_model": True}})
    assert echelon3("train", tmp_path) == 2
    err = capsys.readouterr().err
    assert "mlflow.log_model: unknown key (did you mean 'log_models'?)" in err, err
    assert "Traceback" not in err

"""The report's part in MLflow tracking: the leaderboard's link to each experiment's
MLflow run, and the learning curves sent to that run. An experiment trained with the
`mlflow` key set has an `mlflow` entry in its summary.json (echelon3.observe.mlflow)
naming its tracking URI, run and page; the others have none and get no link."""

import json
import logging

log = logging.getLogger("report")

COLUMN = "mlflow"
CURVES = "curves"  # the runs' artifact folder for the pictures


def read_run(path):
    """summary.json's `mlflow` entry, or None (no summary, or a run that was not tracked)."""
    if path is None:
        return None
    try:
        with open(path) as f:
            entry = json.load(f).get(COLUMN)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) and entry.get("run_id") else None


def link(entry):
    """The run's page (the tracking server's, or `mlflow ui`'s for a local store)."""
    return (entry or {}).get("url") or None


def log_curves(entries, pictures):
    """Each tracked run gets its learning-curve picture under `curves/`. A tracking
    server that refuses gets one warning in the report's log; the report goes on."""
    sent = 0
    for entry, picture in zip(entries, pictures):
        if not entry or not entry.get("logged", True):
            continue
        try:
            from mlflow import MlflowClient

            MlflowClient(tracking_uri=entry["tracking_uri"]).log_artifact(
                entry["run_id"], str(picture), CURVES)
            sent += 1
        except Exception as e:  # noqa: BLE001 (the local report is what counts)
            log.warning("MLflow at %s refused the learning curves (%s: %s); they stay in "
                        "results/plots/curves/", entry.get("tracking_uri"), type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            return sent
    if sent:
        log.info("sent %d learning-curve pictures to their MLflow runs", sent)
    return sent

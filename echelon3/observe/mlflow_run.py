"""What an MLflow run is told about an echelon3 run: parameters, metric names, tags, links."""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import subprocess
from pathlib import Path

from echelon3 import __version__

EXPERIMENT_ENV = "ECHELON3_EXPERIMENT"  # the workflow's experiment (results/<name>)
SWEEP_ENV = "ECHELON3_SWEEP"  # the workflow's sweep the experiment belongs to
MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_KEY = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_TAG_VALUE = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` serves a local store by default
_NOT_A_NAME = re.compile(r"[^\w\-. /:]")  # MLflow's metric and parameter names


def metric_key(name: str) -> str:
    """``name`` in the characters MLflow accepts in a metric or parameter name."""
    return _NOT_A_NAME.sub("_", name)[:MAX_KEY]


def _scalar(value) -> str:
    text = json.dumps(value) if isinstance(value, bool) or value is None else str(value)
    return text[:MAX_PARAM_VALUE]


def flatten(node, prefix: str = "") -> dict[str, str]:
    """A resolved config as ``dotted.key -> value`` strings: mappings and lists of mappings
    are walked (list items by index), other lists kept whole as JSON; values cut to the
    6000 characters MLflow takes."""
    out: dict[str, str] = {}
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list) and any(isinstance(v, dict | list) for v in node):
        items = enumerate(node)
    else:
        value = json.dumps(node, default=str) if isinstance(node, list) else node
        return {metric_key(prefix): _scalar(value)} if prefix else {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def git_commit(folder: Path | None = None) -> str | None:
    """The commit checked out where the run was started, when that is a git repository."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder or os.getcwd(),
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def run_tags(task: str, extra: dict[str, str]) -> dict[str, str]:
    """Who ran what where: echelon3's version, the git commit, the host, the workflow's
    experiment and sweep, and what the task adds (world size, precision)."""
    tags = {"echelon3.version": __version__, "echelon3.task": task,
            "host": socket.gethostname(), "mlflow.source.name": f"echelon3 {task}"}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):
        pass
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    for env, tag in ((EXPERIMENT_ENV, "snakemake.experiment"), (SWEEP_ENV, "snakemake.sweep")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    tags.update(extra)
    return {metric_key(k): str(v)[:MAX_TAG_VALUE] for k, v in tags.items()}


def run_url(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """The run's page: on the tracking server, or on `mlflow ui` for a local store."""
    if not (experiment_id and run_id):
        return None
    base = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) \
        else UI_URL
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def state_file(path: Path) -> dict | None:
    """``mlflow.json`` of a run folder, or None when missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("run_id") else None

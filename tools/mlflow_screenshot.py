"""``python -m tools.mlflow_screenshot [--out docs/img/mlflow-sweep.png]``: the picture on
the Tracking page, `mlflow ui` over a sweep of three experiments, taken with headless
Chromium (``apt-get install chromium``, or ``--chromium PATH``).

In a scratch copy of the workflow it runs a three-point learning-rate sweep of
``digits_mlp`` with ``mlflow=true`` (the local store, ``mlflow.db``) through
``snakemake -j1``, starts ``mlflow ui`` there and photographs MLflow's compare view
of the sweep's three runs. The picture is dated in a footer line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SWEEP = "mlp_lr"
LRS = [0.1, 0.03, 0.01]
EPOCHS = 6


def sweep_project(folder: Path) -> Path:
    """The workflow in ``folder``, its config a sweep of three, tracked."""
    shutil.copy2(REPO / "Snakefile", folder / "Snakefile")
    for part in ("workflow", "config", "profiles"):
        shutil.copytree(REPO / part, folder / part, ignore=shutil.ignore_patterns("__pycache__"))
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    config["experiments"] = {}
    config["sweeps"] = {SWEEP: {
        "config": "digits_mlp", "overrides": [f"trainer.config.epochs={EPOCHS}", "mlflow=true"],
        "grid": {"optimizer.config.lr": LRS}, "resources": {"gpus": 0, "cpus": 2}}}
    (folder / "config/config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "SLURM_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow ui did not answer at {url}")


def photograph(chromium: str, url: str, out: Path, size: str) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", f"--user-data-dir={profile}",
                        f"--window-size={size}", "--virtual-time-budget=40000",
                        f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=300)


def date_it(path: Path, line: str) -> None:
    """A footer line under the picture: when and how it was taken."""
    from PIL import Image, ImageDraw

    shot = Image.open(path).convert("RGB")
    framed = Image.new("RGB", (shot.width, shot.height + 28), "white")
    framed.paste(shot, (0, 0))
    ImageDraw.Draw(framed).text((10, shot.height + 8), line, fill=(60, 60, 60))
    framed.save(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs/img/mlflow-sweep.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--size", default="1600,1500")
    parser.add_argument("--project", type=Path,
                        help="build the sweep project here and keep it (rerun: reuse it)")
    args = parser.parse_args(argv)
    import mlflow
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory() as scratch:
        project = args.project or Path(scratch)
        project.mkdir(parents=True, exist_ok=True)
        if not (project / "Snakefile").exists():
            sweep_project(project)
        subprocess.run([sys.executable, "-m", "snakemake", "-j1", "results/leaderboard.csv"],
                       cwd=project, env=_env(), check=True)
        client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
        experiment = client.get_experiment_by_name(SWEEP).experiment_id
        port = _free_port()
        ui = subprocess.Popen([str(BIN / "mlflow"), "ui", "--port", str(port)], cwd=project,
                              env=_env(), start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_for(f"{base}/health", ui)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            runs = [r.info.run_id for r in client.search_runs([experiment])]
            photograph(args.chromium, f"{base}/#/compare-runs?runs={quote(json.dumps(runs))}"
                       f"&experiments={quote(json.dumps([experiment]))}", args.out, args.size)
        finally:
            os.killpg(ui.pid, signal.SIGTERM)
            ui.wait(timeout=30)
    stamp = datetime.date.today().isoformat()
    date_it(args.out, f"mlflow ui {mlflow.__version__} over the sweep '{SWEEP}' "
            f"(optimizer.config.lr {LRS}, {EPOCHS} epochs), {stamp}, "
            "python -m tools.mlflow_screenshot")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``echelon3 profiles install``: `snakemake --profile slurm`, by its bare name, from the
project root; a site's own profile is kept unless --force. HOME and XDG_CONFIG_HOME point
into tmp_path, so the real ~/.config/snakemake is never touched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.workflow.helpers import copy_workflow, env_with, snakemake

PROJECT_PROFILES = ("local", "slurm")


@pytest.fixture
def home(tmp_path) -> dict:
    """An environment whose user config folder is tmp_path/config."""
    (tmp_path / "home").mkdir()
    return env_with(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"))


def install(cwd: Path, env: dict, *args: str):
    return run_cli(["profiles", "install", *args], cwd=cwd, env=env, timeout=60)


def test_the_bare_profile_name_works_after_install(tmp_path, home):
    wf = copy_workflow(tmp_path / "wf")
    before = snakemake(wf, "--profile", "slurm", "-n", env=home, check=False)
    assert "no profile.yaml (or config.yaml) found" in before

    result = install(wf, home)
    assert result.returncode == 0, result.stderr
    users = tmp_path / "config" / "snakemake"
    for name in PROJECT_PROFILES:
        assert (users / name).resolve() == (wf / "profiles" / name).resolve()
        assert f"{name}: {users / name} -> " in result.stdout
    out = snakemake(wf, "--profile", "slurm", "-n", env=home)
    assert "Using profiles slurm and workflow specific profile profiles/default" in out
    assert "train" in out
    # a link, so profiles/ stays the source: an edit there is what Snakemake reads
    (wf / "profiles" / "slurm" / "config.yaml").write_text(
        (wf / "profiles" / "slurm" / "config.yaml").read_text() + "jobs: 7\n")
    assert yaml.safe_load((users / "slurm" / "config.yaml").read_text())["jobs"] == 7
    again = install(wf, home)
    assert again.returncode == 0 and "slurm: already installed" in again.stdout


def test_a_sites_own_profile_is_kept_unless_forced(tmp_path, home):
    wf = copy_workflow(tmp_path / "wf")
    site = tmp_path / "config" / "snakemake" / "slurm"
    site.mkdir(parents=True)
    (site / "config.yaml").write_text("executor: slurm\njobs: 3\n")

    refused = install(wf, home)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"echelon3: error: {site}: a profile of that name exists and is not this project's; "
        "keep it, or pass --force (moves it aside)"]
    assert not site.is_symlink() and (site / "config.yaml").read_text().endswith("jobs: 3\n")
    assert not (site.parent / "local").exists()  # nothing installed when one is refused

    forced = install(wf, home, "--force")
    assert forced.returncode == 0, forced.stderr
    assert site.resolve() == (wf / "profiles" / "slurm").resolve()
    (aside,) = site.parent.glob("slurm.replaced-*")
    assert (aside / "config.yaml").read_text() == "executor: slurm\njobs: 3\n"
    assert f"moved to {aside}" in forced.stdout


def test_copy_and_a_missing_source(tmp_path, home):
    wf = copy_workflow(tmp_path / "wf")
    copied = install(wf, home, "--copy")
    assert copied.returncode == 0, copied.stderr
    target = tmp_path / "config" / "snakemake" / "slurm"
    assert target.is_dir() and not target.is_symlink()
    assert (target / "config.yaml").read_text() == \
        (wf / "profiles" / "slurm" / "config.yaml").read_text()
    missing = install(tmp_path, home, "--source", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"echelon3: error: {tmp_path / 'nowhere'}: no such folder")
    assert "Traceback" not in missing.stderr
    assert sorted(os.listdir(tmp_path / "config" / "snakemake")) == ["local", "slurm"]

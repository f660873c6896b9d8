"""The conda environment and pyproject list the same packages; CI runs README's command."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.conftest import REPO

# conda-forge names that differ from PyPI's
CONDA_TO_PYPI = {"pytorch": "torch"}


def _split(requirement: str) -> tuple[str, str]:
    name, spec = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", requirement.strip()).groups()
    return name.lower(), spec.replace(" ", "")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = dict(_split(r) for r in project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted.update(_split(r) for r in extra)
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    conda = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and not dep.startswith(("python", "pip")):
            name, spec = _split(dep)
            conda[CONDA_TO_PYPI.get(name, name)] = spec
    assert conda == wanted


def test_torch_pin_in_readme_satisfies_pyproject():
    readme = (REPO / "README.md").read_text()
    pin = re.search(r"torch==([\d.]+)", readme).group(1)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floor = next(r for r in project["dependencies"] if r.startswith("torch>="))
    lower = tuple(int(p) for p in floor.split(">=")[1].split("."))
    assert tuple(int(p) for p in pin.split(".")) >= lower


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text().splitlines()
    command = readme[readme.index("# run the tests") + 1]
    assert "pip install torch==2.13.0" in command and "pytest" in command
    ci = (REPO / ".ci" / "run").read_text()
    assert "grep -A1 -x '# run the tests' README.md" in ci


def test_readme_cli_examples_stay_out_of_the_workflows_results():
    """A CLI run in results/<exp> would leave the workflow's outputs out of step."""
    readme = (REPO / "README.md").read_text()
    commands = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S)
                for line in block.splitlines() if re.match(r"echelon3 (train|evaluate|run) ", line)]
    assert commands
    for line in commands:
        if "-cn digits_" in line:
            assert re.search(r"target\.path=(?!results/)\S+", line), line

"""Runs the examples of the documentation pages (Sybil finds them, these evaluators run them).

Every fenced ``bash``, ``yaml`` and ``python`` block of a page is an example,
run in page order inside a scratch copy of the project (``config/``,
``workflow/``, ``profiles/``, ``Snakefile``) shared by the page's blocks:

- ``bash``: the block runs command by command (continuation lines joined): a
  plain ``echelon3 ...`` line through the real CLI in this process (one torch
  start-up for all of them), any other line with ``bash -euo pipefail``;
- ``yaml``: an echelon3 config, or a fragment of one merged onto
  ``config/experiments/digits_cnn.yaml``, composed with ``--print-config`` and
  checked as the CLI's pre-flight does (every module imported, every type found,
  batch sizes divisible by the world size); a workflow config (``experiments:``)
  is validated against ``workflow/schemas/config.schema.yaml`` and the configs
  it names must exist;
- ``python``: executed.

A block that shows a shipped file includes it, as the site does
(``pymdownx.snippets``, paths from the repository root)::

    ```yaml title="config/experiments/digits_mlp_ft.yaml"
    --8<-- "config/experiments/digits_mlp_ft.yaml"
    ```

The runner resolves the include the same way, so the example it runs is the
real file; :func:`copied_quotes` finds blocks that claim to be a shipped file
(by their title, or a lead-in sentence naming it) without including it.

An HTML comment right above a block changes how it runs (invisible on the site)::

    <!-- test: epochs=1 -->           train / finetune for 1 epoch (too slow for CI otherwise)
    <!-- test: dry-run -->            snakemake gets -n, echelon3 gets --print-config
    <!-- test: file=my/nets.py -->    the block is that file's content: written, then
                                      checked as its language says
    <!-- test: exit=2 -->             the block must fail with this exit code
    <!-- test: skip because ... -->   not run; the reason is required

Shortening and dry runs work through small wrappers put first on ``PATH`` (so
commands run by Snakemake jobs are shortened too), and by adding the same
arguments to the in-process calls.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import yaml
from sybil import Document
from sybil.parsers.markdown import CodeBlockParser

from tests.conftest import BIN, REPO

PROJECT_PARTS = ("config", "workflow", "profiles", "Snakefile")
BASE_CONFIG = "digits_cnn"
BLOCK_TIMEOUT_S = 300
_MARK = re.compile(r"<!--\s*test:\s*(.*?)\s*-->\Z", re.S)

WRAPPER = """#!/usr/bin/env bash
# Stands in for {name} while the docs examples run (see tests/docs_runner.py).
extra=()
if [ "{name}" = echelon3 ] && [[ "${{1:-}}" =~ ^(train|finetune)$ ]] && [ -n "${{DOCS_EPOCHS:-}}" ]; then
    extra+=("trainer.config.epochs=$DOCS_EPOCHS")
fi
if [ -n "${{DOCS_DRY_RUN:-}}" ]; then
    if [ "{name}" = echelon3 ]; then extra+=(--print-config); else extra+=(-n); fi
fi
exec "{real}" "$@" "${{extra[@]}}"
"""


def scratch_project(root: Path) -> Path:
    """A copy of the project's runnable parts, with the wrappers in ``root/bin``."""
    project = root / "project"
    project.mkdir(parents=True)
    for part in PROJECT_PARTS:
        source = REPO / part
        if source.is_dir():
            shutil.copytree(source, project / part,
                            ignore=shutil.ignore_patterns("__pycache__", ".snakemake"))
        elif source.exists():
            shutil.copy2(source, project / part)
    wrappers = root / "bin"
    wrappers.mkdir()
    for name in ("echelon3", "snakemake"):
        real = BIN / name
        path = wrappers / name
        path.write_text(WRAPPER.format(name=name, real=real))
        path.chmod(0o755)
    return project


def marker(example) -> str:
    """The ``<!-- test: ... -->`` text right above the example's block, or ''."""
    above = example.document.text[:example.start].rstrip()
    found = _MARK.match(above[above.rfind("<!--"):]) if above.endswith("-->") else None
    return found.group(1) if found else ""


def _options(mark: str) -> dict[str, str]:
    if mark.startswith("skip"):
        if not mark.removeprefix("skip").strip():
            raise AssertionError("a skipped docs example must say why: <!-- test: skip because ... -->")
        for path in re.findall(r"\b((?:tests|benchmarks|workflow)/[\w/.-]+\.py)\b", mark):
            if not (REPO / path).is_file():
                raise AssertionError(f"a skip reason names {path}, which does not exist")
        return {"skip": mark}
    options = {}
    for word in mark.split():
        key, _, value = word.partition("=")
        options[key] = value or "1"
    unknown = set(options) - {"epochs", "dry-run", "file", "exit"}
    if unknown:
        raise AssertionError(f"unknown docs test option(s): {', '.join(sorted(unknown))}")
    return options


class PageRun:
    """State shared by the examples of one page: where they run, what they did."""

    def __init__(self, root: Path):
        self.root = root
        self.project = scratch_project(root)
        self.ran: list[str] = []
        self.skipped: list[str] = []
        # Commands that write to the user's config folder (profiles install) write here.
        self.private_env = {"XDG_CONFIG_HOME": str(root / "config-home")}

    def env(self, options: dict[str, str]) -> dict[str, str]:
        env = {**os.environ, "PATH": f"{self.root / 'bin'}{os.pathsep}{BIN}{os.pathsep}"
               f"{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
        for name in ("RANK", "WORLD_SIZE", "DOCS_EPOCHS", "DOCS_DRY_RUN"):
            env.pop(name, None)
        env.update(self.private_env)
        if "epochs" in options:
            env["DOCS_EPOCHS"] = options["epochs"]
        if "dry-run" in options:
            env["DOCS_DRY_RUN"] = "1"
        return env

    # ------------------------------------------------------------------ evaluators

    def _begin(self, example) -> dict[str, str] | None:
        options = _options(marker(example))
        where = f"{Path(example.path).name} line {example.line}"
        if "skip" in options:
            self.skipped.append(f"{where}: {options['skip']}")
            return None
        self.ran.append(where)
        if "file" in options:
            path = self.project / options["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(example.parsed)
        return options

    def bash(self, example) -> None:
        options = self._begin(example)
        if options is None:
            return
        wanted = int(options.get("exit", 0))
        code, output = 0, ""
        for command in shell_commands(example.parsed):
            words = simple_echelon3(command)
            if words is not None:
                code, output = self.echelon3_in_process(words, options)
            else:
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", command],
                                      cwd=self.project, env=self.env(options), text=True,
                                      capture_output=True, timeout=BLOCK_TIMEOUT_S)
                code, output = done.returncode, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            if code != 0:
                break
        assert code == wanted, (f"exit code {code}, expected {wanted}\n--- command:\n"
                                f"{command}\n--- output:\n{output}")

    def echelon3_in_process(self, words: list[str], options: dict[str, str]) -> tuple[int, str]:
        """``echelon3 ...`` through the real CLI in this process: no second torch start-up."""
        from echelon3 import cli

        args = words[1:]
        if "epochs" in options and args[:1] in (["train"], ["finetune"]):
            args.append(f"trainer.config.epochs={options['epochs']}")
        if "dry-run" in options:
            args.append("--print-config")
        cwd, saved = os.getcwd(), {k: os.environ.get(k) for k in self.private_env}
        os.chdir(self.project)
        os.environ.update(self.private_env)
        printed = io.StringIO()
        try:
            with redirect_stdout(printed), redirect_stderr(printed):
                code = cli.main(args)
        except SystemExit as e:  # argparse
            code = int(e.code or 0)
        finally:
            os.chdir(cwd)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        return code, printed.getvalue()[-3000:]

    def python(self, example) -> None:
        options = self._begin(example)
        if options is None or "file" in options:
            return
        namespace = example.namespace
        cwd = os.getcwd()
        os.chdir(self.project)
        try:
            exec(compile(example.parsed, f"{example.path}:{example.line}", "exec"), namespace)
        finally:
            os.chdir(cwd)

    def yaml(self, example) -> None:
        options = self._begin(example)
        if options is None:
            return
        data = yaml.safe_load(example.parsed)
        assert isinstance(data, dict), "a YAML example must be a mapping"
        if {"experiments", "sweeps", "leaderboard", "config_dir"} & set(data):
            check_workflow_config(data, self.project)
        elif "file" in options and not options["file"].endswith(".yaml"):
            raise AssertionError(f"{options['file']}: only .yaml files are composed")
        else:
            compose_and_check(self.project, example.parsed, options.get("file"))


def shell_commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    commands, current = [], ""
    for line in block.splitlines():
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def simple_echelon3(command: str) -> list[str] | None:
    """The words of a plain ``echelon3 ...`` command (no pipes, redirection, variables)."""
    if not command.startswith("echelon3 ") or re.search(r"[|&;<>$`*?]", command.split(" #")[0]):
        return None
    return shlex.split(command, comments=True)


def check_workflow_config(data: dict, project: Path) -> None:
    """Valid for the workflow's schema, and every run it names has its config file."""
    import jsonschema

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    jsonschema.validate(data, schema)
    folder = project / data.get("config_dir", "config/experiments")
    for section in ("experiments", "sweeps"):
        for name, run in (data.get(section) or {}).items():
            assert (folder / f"{run['config']}.yaml").is_file(), \
                f"{section}.{name}: no {run['config']}.yaml in {folder}"


def compose_and_check(project: Path, text: str, file: str | None) -> None:
    """``--print-config`` the block (a fragment goes onto digits_cnn), then pre-flight it."""
    from echelon3 import cli
    from echelon3.config import compose as config
    from echelon3.config import preflight
    from echelon3.data import loaders as data

    if file is None:
        directory = project / "config" / "experiments"
        name = "docs_example"
        body = yaml.safe_load(text)
        if "defaults" not in body and not {"net", "data"} <= set(body):
            text = f"defaults: [{BASE_CONFIG}, _self_]\n{text}"
        (directory / f"{name}.yaml").write_text(text)
    else:
        path = project / file
        directory, name = path.parent, path.stem
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(project)
    try:
        with redirect_stdout(out):
            code = cli.main(["train", "-cd", str(directory), "-cn", name, "--print-config"])
        assert code == 0, f"--print-config failed with exit code {code}"
        rc = config.load_config(directory, name, [])
        gpus, nproc = rc.cfg.get("gpus"), rc.cfg.get("nproc")
        world = len(gpus) if gpus is not None and not isinstance(gpus, int) else (nproc or 1)
        data.check_batch_sizes(rc.cfg.get("dataloaders"), world)
        from echelon3.tasks.train import RUNTIME_KEYS  # trainer.config keys train reads itself

        preflight.check_specs(rc.cfg, rc.config_dir, consumed={"trainer": tuple(RUNTIME_KEYS)})
    finally:
        os.chdir(cwd)
    assert yaml.safe_load(out.getvalue()), "--print-config printed nothing"


def parse_page(path: Path, run: PageRun) -> Document:
    """The page's examples, includes resolved, each bound to the evaluator of its language."""
    parsers = [CodeBlockParser("bash", run.bash), CodeBlockParser("yaml", run.yaml),
               CodeBlockParser("python", run.python)]
    text = ATTRIBUTES.sub(r"\1", expand_includes(Path(path).read_text()))  # Sybil: language only
    document = Document(text, str(path))
    for parser in parsers:
        for region in parser(document):
            document.add(region)
    return document


# --------------------------------------------------------------------------- includes

INCLUDE = re.compile(r'^(?P<indent>[ \t]*)--8<--\s+"(?P<path>[^"]+)"[ \t]*$', re.M)
FENCE = re.compile(r'^(?P<indent>[ \t]*)(?P<fence>```+)[ \t]*(?P<info>[^\n]*)\n'
                   r'(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$', re.M | re.S)
TITLE = re.compile(r'title="([^"]+)"')
ATTRIBUTES = re.compile(r"^([ \t]*```+[\w+-]+)[ \t]+[^\n]*$", re.M)  # ```yaml title="..."
SHIPPED_KINDS = {"yaml": (".yaml", ".yml"), "python": (".py",)}


def expand_includes(text: str, root: Path = REPO) -> str:
    """``text`` with each ``--8<-- "path"`` line replaced by that file, as
    pymdownx.snippets does with ``base_path: [.]`` and ``check_paths: true``."""
    def include(match: re.Match) -> str:
        path = root / match["path"]
        if not path.is_file():
            raise AssertionError(f'--8<-- "{match["path"]}": no such file')
        body = path.read_text().rstrip("\n")
        return "\n".join(match["indent"] + line if line else line
                         for line in body.splitlines())

    return INCLUDE.sub(include, text)


def _lead_in(text: str, start: int) -> str:
    """The sentence right above a block when it ends in ':' (it introduces the block)."""
    above = text[:start].rstrip()
    if not above.endswith(":"):
        return ""
    paragraph = re.split(r"\n\s*\n|```", above)[-1]
    return re.split(r"(?<=[.!?])\s", paragraph)[-1]


def copied_quotes(text: str, root: Path = REPO) -> list[str]:
    """Blocks that show a shipped file without including it: the block's title names a
    file of the repository, or the sentence introducing it names one of the block's
    kind in backticks; the block must then be exactly ``--8<-- "that file"``."""
    problems = []
    for block in FENCE.finditer(text):
        language = block["info"].split()[0] if block["info"].strip() else ""
        title = TITLE.search(block["info"])
        named = [title.group(1)] if title else [
            path for path in re.findall(r"`([\w./-]+)`", _lead_in(text, block.start()))
            if path.endswith(SHIPPED_KINDS.get(language, ("\0",)))]
        shipped = [path for path in named if (root / path).is_file()]
        if not shipped:
            continue
        included = [m["path"] for m in INCLUDE.finditer(block["body"])]
        if included != shipped[:1] or block["body"].strip() != f'--8<-- "{shipped[0]}"':
            line = text.count("\n", 0, block.start()) + 1
            problems.append(f"line {line}: a {language or 'text'} block shows {shipped[0]} "
                            f'but is not --8<-- "{shipped[0]}"')
    return problems


def fence_languages(text: str) -> list[str]:
    """The info string of every fenced block (so none hides in an unrun language)."""
    return re.findall(r"^\s*```+\s*([\w+-]*)", text, re.M)[::2]


"""The docs' generated parts match the code, the site builds strictly, README's links resolve."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tools.gendocs import __main__ as gendocs
from tools.gendocs import error_sites, regions, troubleshooting
from tools.gendocs.config_keys import reads


def test_generated_regions_match_the_code():
    stale = [page for page, (old, new) in gendocs.generate().items() if old != new]
    assert not stale, f"out of date: {stale}; run `python -m tools.gendocs`"


def test_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "WARNING" not in done.stderr, done.stderr[-4000:]
    troubleshooting_html = (tmp_path / "site" / "troubleshooting" / "index.html").read_text()
    assert "unknown root key" in troubleshooting_html
    api_html = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "dist_reduce" in api_html and "SAMOptimizer" in api_html


def test_readme_links_point_at_files():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "README links into the docs pages"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    import yaml

    class Loader(yaml.SafeLoader):
        """mkdocs.yml's ``!!python/name:`` values (a fence's formatter) read as their text."""

    Loader.add_multi_constructor("tag:yaml.org,2002:python/",
                                 lambda loader, suffix, node: suffix)
    nav = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=Loader)["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)

    listed = set(pages(nav))
    on_disk = {p.name for p in (REPO / "docs").glob("*.md")}
    assert listed == on_disk


# ----------------------------------------------------------------------------- the scanners

def _repo_with(tmp_path, files: dict[str, str]):
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_scan_finds_user_errors_of_derived_classes_and_renders_placeholders(tmp_path):
    repo = _repo_with(tmp_path, {
        "echelon3/config/errors.py": """
            class UserError(Exception): ...
            class ConfigError(UserError): ...
        """,
        "echelon3/checkpoints/lock.py": """
            '''The run-folder lock.'''
            from echelon3.config.errors import ConfigError
            HINT = "stop the other run first"
            class LockError(ConfigError): ...
            def take(path, pid):
                raise LockError(str(path), f"held by pid {pid}; {HINT}")
            def parse(text):
                raise ValueError(f"not a number: {text!r}")
            class Net:
                def __init__(self, width):
                    raise ValueError("width must be positive")
        """,
    })
    sites = {site.text: site for site in error_sites.scan(repo)}
    assert "echelon3: error: <path>: held by pid <pid>; stop the other run first" in sites
    assert sites["echelon3: error: <path>: held by pid <pid>; stop the other run first"] \
        .places == ["take"]
    assert "ValueError: not a number: <text>" in sites
    assert sites["ValueError: not a number: <text>"].exit_code == 1
    assert "echelon3: error: <section>: Net rejected its arguments: width must be positive" \
        in sites


def test_an_unexplained_message_fails_generation(tmp_path, monkeypatch):
    repo = _repo_with(tmp_path, {
        "echelon3/config/errors.py": "class UserError(Exception): ...\n",
        "echelon3/x.py": "def f():\n    raise UserError('k', 'a brand-new failure')\n",
    })
    with pytest.raises(troubleshooting.Unexplained, match="a brand-new failure"):
        troubleshooting.collect(repo)


def test_python_of_smk_keeps_functions_and_drops_rules():
    text = textwrap.dedent("""
        import os


        rule train:
            input: "a"
            shell: "echo"


        def helper(x):
            raise WorkflowError(f"bad {x}")
    """)
    tree = ast.parse(error_sites._python_of_smk(text))
    assert [type(n).__name__ for n in tree.body] == ["Import", "FunctionDef"]


def test_reads_finds_defaults_of_get_and_or():
    tree = ast.parse("def f(cfg):\n    a = cfg.get('seed', 0)\n    b = cfg.get('device') or "
                     "'auto'\n    c = other.get('x', 1)\n    d = cfg.get('gpus')\n")
    found = {k: (ast.unparse(v) if v is not None else None)
             for k, v in reads(tree, ("cfg",)).items()}
    assert found == {"seed": "0", "device": "'auto'", "gpus": None}


def test_region_replacement_keeps_the_rest_of_the_page():
    start, end = (regions.START.format(name="t"), regions.END.format(name="t"))
    page = f"# Title\n\nintro\n\n{start}\nold\n{end}\n\noutro\n"
    new = regions.replace(page, "t", "new body")
    assert new == f"# Title\n\nintro\n\n{start}\nnew body\n{end}\n\noutro\n"
    assert regions.names(new) == ["t"]
    with pytest.raises(regions.RegionError):
        regions.replace("no markers", "t", "x")


def test_benchmarks_show_the_newest_section_of_each_script_and_kind_of_table(tmp_path):
    from tools.gendocs import benchmarks

    results = tmp_path / "benchmarks" / "RESULTS.md"
    results.parent.mkdir()
    results.write_text("# Benchmark results\n\n## parity — 2026-11-30 10:00 UTC\n\nold table\n\n"
                       "## ddp_cpu — 2026-11-30 11:00 UTC\n\n| a |\n|---|\n\n"
                       "## parity — 2026-11-30 12:00 UTC\n\nnew table\n\n"
                       "## parity — 2026-11-30 13:00 UTC\n\n| DDP row |\n|---|\n| old |\n\n"
                       "## parity — 2026-11-30 14:00 UTC\n\n| DDP row |\n|---|\n| new |\n")
    page = benchmarks.render(tmp_path)
    assert "new table" in page and "old table" not in page
    assert "| new |" in page and "| old |" not in page
    assert (page.index("`parity`, 2026-11-30 12:00 UTC") < page.index("`parity`, 2026-11-30 14:00")
            < page.index("`ddp_cpu`"))
    only = benchmarks.render(tmp_path, ("gpu_check", "ddp_cpu"))
    assert "| a |" in only and "Not measured yet: `benchmarks/gpu_check.py`" in only

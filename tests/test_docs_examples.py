"""Every shell, YAML and Python block of the documentation runs (see tests/docs_runner.py)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.docs_runner import PageRun, fence_languages, parse_page

PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
LANGUAGES = {"bash", "yaml", "python", "text"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_examples_run(page, tmp_path):
    run = PageRun(tmp_path)
    examples = list(parse_page(page, run))
    for example in examples:
        example.evaluate()
    assert len(run.ran) + len(run.skipped) == len(examples)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_is_in_a_language_the_runner_knows(page):
    # A block in another language (sh, console, yml...) would be silently left unrun.
    # Output and file listings are `text`.
    unknown = [lang or "(none)" for lang in fence_languages(page.read_text())
               if lang not in LANGUAGES]
    assert not unknown, f"{page.name}: blocks in {unknown}; use one of {sorted(LANGUAGES)}"

"""Every shell, YAML and Python block of the documentation runs (see tests/docs_runner.py)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.docs_runner import PageRun, copied_quotes, expand_includes, fence_languages, parse_page

PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
# mermaid: docs/architecture.md's diagram, whose arrows tests/test_layers.py checks
LANGUAGES = {"bash", "yaml", "python", "text", "mermaid"}


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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_that_shows_a_shipped_file_includes_it(page):
    assert not copied_quotes(page.read_text()), "\n".join(
        [f"{page.name}: {problem}" for problem in copied_quotes(page.read_text())] +
        ['show it with --8<-- "<path>" inside the block (pymdownx.snippets), not a copy'])


SHIPPED = "config/experiments/digits_mlp_ft.yaml"
LEAD_IN = f"`{SHIPPED}` fine-tunes `digits_mlp`:\n\n"


def test_a_copy_that_drifted_from_the_shipped_file_is_found():
    real = (REPO / SHIPPED).read_text()
    drifted = real.replace("max_steps: 40", "max_steps: 41")
    assert drifted != real
    for page in (f"{LEAD_IN}```yaml\n{drifted}```\n",  # named in the sentence before
                 f'```yaml title="{SHIPPED}"\n{drifted}```\n',  # named in the title
                 f"{LEAD_IN}```yaml\n{real}```\n"):  # even an exact copy can drift later
        assert copied_quotes(page) == [
            f'line {page.count(chr(10), 0, page.index("```")) + 1}: a yaml block shows '
            f'{SHIPPED} but is not --8<-- "{SHIPPED}"'], page
    assert copied_quotes(f'{LEAD_IN}```yaml\n--8<-- "{SHIPPED}"\n```\n') == []
    assert copied_quotes("Any settings will do:\n\n```yaml\nseed: 1\n```\n") == []


def test_the_runner_runs_the_included_file_itself(tmp_path):
    page = REPO / "docs" / "finetune-export.md"
    assert f'--8<-- "{SHIPPED}"' in page.read_text()
    blocks = [example.parsed for example in parse_page(page, PageRun(tmp_path))]
    assert (REPO / SHIPPED).read_text().rstrip("\n") + "\n" in blocks
    assert not any("--8<--" in block for block in blocks)
    with pytest.raises(AssertionError, match="no such file"):
        expand_includes('```yaml\n--8<-- "config/experiments/missing.yaml"\n```\n')

"""``python -m tools.gendocs [--check]``: regenerate (or check) every generated region."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from tools.gendocs import benchmarks, cli_reference, config_keys, regions, troubleshooting

REPO = Path(__file__).resolve().parents[2]
# Sections of benchmarks/RESULTS.md that the Multi-GPU and precision page shows.
MULTI_GPU_BENCHMARKS = ("gpu_check", "ddp_cpu")


def renderers(repo: Path) -> dict[str, dict[str, Callable[[], str]]]:
    """Page (relative to the repository) -> region name -> function rendering its body."""
    tables = {}

    def table(name: str) -> Callable[[], str]:
        def render() -> str:
            if not tables:
                tables.update(config_keys.render_tables(repo))
            return tables[name]
        return render

    return {
        "docs/configuration.md": {name: table(name) for name in (
            "root-keys", "trainer-keys", "target-keys", "dataloader-keys", "evaluator-keys",
            "runner-keys")},
        "docs/workflow.md": {"workflow-keys": table("workflow-keys")},
        "docs/troubleshooting.md": {"messages": lambda: troubleshooting.render(repo)},
        "docs/cli.md": {"cli": cli_reference.render},
        "docs/benchmarks.md": {"results": lambda: benchmarks.render(repo)},
        "docs/multi-gpu.md": {"measured": lambda: benchmarks.render(repo, MULTI_GPU_BENCHMARKS),
                              "memory": lambda: benchmarks.render(repo, ("memory",))},
    }


def generate(repo: Path = REPO) -> dict[str, tuple[str, str]]:
    """Page -> (text now, text regenerated)."""
    pages = {}
    for page, regions_of_page in renderers(repo).items():
        path = repo / page
        old = path.read_text()
        new = old
        for name, render in regions_of_page.items():
            new = regions.replace(new, name, render())
        pages[page] = (old, new)
    return pages


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m tools.gendocs", description=__doc__)
    cli.add_argument("--check", action="store_true", help="only list the pages out of date")
    check = cli.parse_args(argv).check
    stale = []
    for page, (old, new) in generate().items():
        if old != new:
            stale.append(page)
            if not check:
                (REPO / page).write_text(new)
    verb = "out of date" if check else "rewritten"
    for page in stale:
        print(f"{page}: {verb}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

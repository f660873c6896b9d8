"""The rules read the standard way: `snakemake --lint` clean, snakefmt formatted."""

from __future__ import annotations

import subprocess
import sys

from tests.workflow.helpers import DRY_S, REPO, copy_workflow, snakemake


def test_snakemake_lint_is_clean(tmp_path):
    out = snakemake(copy_workflow(tmp_path), "--lint")
    assert "Lints for" not in out, out
    assert "Congratulations" in out


def test_rules_are_snakefmt_formatted():
    files = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", *map(str, files)],
                          text=True, capture_output=True, timeout=DRY_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr

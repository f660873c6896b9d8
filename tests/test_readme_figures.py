"""benchmarks/readme_figures.py: the figures of the embedded default (docs/getting-started.md)
are the script's table, dated, not numbers typed by hand."""

from __future__ import annotations

import importlib.util
import json
import re

import yaml

from tests.conftest import REPO


def script():
    spec = importlib.util.spec_from_file_location("readme_figures",
                                                  REPO / "benchmarks" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_table_is_the_scripts_output_between_its_markers():
    figures = script()
    readme = figures.PAGE.read_text()
    region = readme.split(figures.START, 1)[1].split(figures.END, 1)[0].strip().splitlines()
    assert region[0].startswith("| run | training (`echelon3 train`, after start-up) |")
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    names = [re.match(r"\| `([^`]+)`", line).group(1) for line in region[2:-3]]
    assert names == list(config["experiments"])
    assert re.fullmatch(r"Measured \d{4}-\d{2}-\d{2} on \d+ CPU cores \(load average "
                        r"[\d.]+ at the start, [\d.]+ at the end\), torch \S+, by one run of "
                        r"`python benchmarks/readme_figures.py` .*", region[-1])
    # one total for the workflow on the page: this table's
    assert len(re.findall(r"\d+ s in all", figures.PAGE.read_text())) == 1


def test_the_script_writes_what_the_runs_left(tmp_path):
    figures = script()
    (tmp_path / "config").mkdir()
    (tmp_path / "config/config.yaml").write_text(yaml.safe_dump({"experiments": {"a": {},
                                                                                 "b": {}}}))
    for name, summary in (("a", {"epochs": 10, "elapsed_s": 12.4, "best": {"epoch": 7}}),
                          ("b", {"epochs": 2, "steps": 40, "max_steps": 40, "elapsed_s": 3.1,
                                 "best": {"epoch": 3, "step": 40}})):
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "summary.json").write_text(json.dumps(summary))
        (tmp_path / "results" / name / "metrics.json").write_text(json.dumps(
            {"accuracy": 0.99555}))
    text = figures.table(tmp_path, 31.2, 20.4, (1.25, 3.5))
    assert "| `a` (10 epochs) | 12 s | 0.9956 | 7 |" in text
    assert "| `b` (40 steps) | 3 s | 0.9956 | 3 (step 40) |" in text  # counted in steps
    assert "(load average 1.2 at the start, 3.5 at the end)" in text
    assert "| 31 s in all (20 s of CPU) |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{figures.START}\nold\n{figures.END}\nafter\n")
    figures.rewrite(readme, text)
    assert readme.read_text() == f"before\n{figures.START}\n{text}\n{figures.END}\nafter\n"

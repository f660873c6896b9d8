"""The package's layers.

- No module imports one that (directly or not) imports it back, counting imports inside
  functions too (a lazy import is still a dependency).
- The wings have an order (:data:`WINGS`, bottom first): no module imports a wing above
  its own.
- The diagram in ``docs/architecture.md`` draws the real imports between wings: its
  arrows are exactly the wing imports that no path of other arrows already implies.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "echelon3"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Bottom first. A module may import its own wing and the wings of lower levels; wings of
# one level (the components configs name) may import each other.
WINGS: list[tuple[str, ...]] = [
    ("config",),
    ("data",),
    ("distributed",),
    ("checkpoints",),
    ("observe",),
    ("nets", "datasets", "losses", "metrics", "optimizers"),
    ("trainers",),
    ("tasks",),
    ("api",),
    ("cli",),
    ("warm",),
]
LEVEL = {wing: level for level, wings in enumerate(WINGS) for wing in wings}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> dict[str, int]:
    """The echelon3 modules ``path`` imports, anywhere in the file, with a line of each."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name in known:
                found.setdefault(name, node.lineno)
    return found


def import_lines() -> dict[str, dict[str, int]]:
    """{module: {imported module: line}} over the whole package."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    return {name: {m: line for m, line in imports(path, known).items() if m != name}
            for name, path in files.items()}


def import_graph() -> dict[str, set[str]]:
    return {name: set(found) for name, found in import_lines().items()}


def wing(module: str) -> str | None:
    """The wing a module belongs to (None: the package root, which every wing may use)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return "cli" if parts[1] == "__main__" else parts[1]  # api.py: the wing api


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node], _ = 2, path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def upward_imports(lines: dict[str, dict[str, int]]) -> list[str]:
    """``file:line: a imports b (wing x above wing y)`` for every import against the order."""
    found = []
    for module, imported in sorted(lines.items()):
        own = wing(module)
        for other, line in sorted(imported.items()):
            target = wing(other)
            if own is None or target is None or own == target:
                continue
            if own not in LEVEL or target not in LEVEL:
                found.append(f"{module} -> {other}: wing {own if own not in LEVEL else target} "
                             "is in no level of WINGS")
            elif LEVEL[target] > LEVEL[own] or (LEVEL[target] == LEVEL[own] and own == "cli"):
                path = module.replace(".", "/")
                found.append(f"{path}.py:{line}: {module} imports {other} "
                             f"(wing {target} is above wing {own})")
    return found


def wing_graph(lines: dict[str, dict[str, int]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, imported in lines.items():
        own = wing(module)
        for other in imported:
            target = wing(other)
            if own and target and own != target:
                graph.setdefault(own, set()).add(target)
    return graph


def reduction(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The edges of a DAG that no longer path implies (its transitive reduction)."""
    def reachable(start: str, skip: tuple[str, str]) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for nxt in graph.get(node, ()):
                if (node, nxt) != skip and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return {(a, b) for a, targets in graph.items() for b in targets
            if b not in reachable(a, (a, b))}


def diagram_arrows(text: str) -> set[tuple[str, str]]:
    """``a --> b`` arrows of the page's mermaid block (``a`` imports ``b``)."""
    block = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert block, f"{ARCHITECTURE}: no mermaid diagram"
    return {(a, b) for a, b in re.findall(r"^\s*(\w+)(?:\[[^\]]*\])?\s*-->\s*(\w+)", block.group(1),
                                          re.M)}


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_wing_is_in_the_order():
    wings = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    files = {"cli", "api"}  # the wings that are one file at the top
    assert wings | files == set(LEVEL), set(LEVEL) ^ (wings | files)


def test_no_module_imports_a_wing_above_its_own():
    upward = upward_imports(import_lines())
    assert not upward, "imports against the order of WINGS:\n" + "\n".join(upward)


def test_a_planted_upward_import_is_found_with_its_line():
    lines = import_lines()
    lines["echelon3.config.build"] = {**lines["echelon3.config.build"],
                                      "echelon3.trainers.baseline": 7}
    assert upward_imports(lines) == ["echelon3/config/build.py:7: echelon3.config.build imports "
                                     "echelon3.trainers.baseline (wing trainers is above wing "
                                     "config)"]
    lines["echelon3.tasks.train"] = {"echelon3.cli": 3}
    assert "echelon3/tasks/train.py:3: echelon3.tasks.train imports echelon3.cli (wing cli is " \
           "above wing tasks)" in upward_imports(lines)


def test_the_reduction_keeps_only_edges_no_path_implies():
    assert reduction({"a": {"b", "c"}, "b": {"c"}}) == {("a", "b"), ("b", "c")}


def test_the_architecture_diagram_draws_the_real_imports():
    drawn = diagram_arrows(ARCHITECTURE.read_text())
    real = reduction(wing_graph(import_lines()))
    assert drawn == real, (f"drawn but not imported: {sorted(drawn - real)}; "
                           f"imported but not drawn: {sorted(real - drawn)}")


def test_the_trainer_imports_no_task():
    graph = import_graph()
    for name in graph:
        if name.startswith("echelon3.trainers"):
            assert not {m for m in graph[name] if wing(m) in ("tasks", "cli")}, name

"""Every error message a user can get, found by reading the code's raise sites.

The scan covers the package, the workflow's helpers (``workflow/rules/*.smk``,
``workflow/scripts/*.py``) and reports, for each error made or raised:

- a :class:`echelon3.config.errors.UserError` (or any class derived from one, in any
  scanned file), wherever it is constructed (a helper may build it for a caller
  to raise): the one line ``echelon3: error: KEY: MESSAGE``, exit code 2;
- ``WorkerFailed``: the launcher's summary of a failed worker;
- ``ValueError`` / ``TypeError`` / ``RuntimeError`` raised by the constructor of
  a built-in component: the builder turns it into a one-line error naming the
  section, exit code 2; raised anywhere else: a traceback, exit code 1;
- ``WorkflowError`` and ``ValueError`` of the workflow: Snakemake stops with it;
  ``config_error(message)`` (workflow/rules/checks.smk): the workflow stops with
  that one line.

Parts computed at run time show as ``<name>`` (a variable) or ``…``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PLAIN_ERRORS = ("ValueError", "TypeError", "RuntimeError")
ROOT_ERROR = "UserError"


@dataclass
class Site:
    """One message, and every place that raises it."""

    source: str          # file, relative to the repository
    kind: str            # exception class
    text: str            # what the user reads
    exit_code: int | None
    places: list[str] = field(default_factory=list)  # function names


# Module-level string constants, inlined where a message uses them: a bare name from the
# file being scanned, ``module.NAME`` from whichever file defines it (if only one does).
_CONSTANTS: dict[str, dict[str, str]] = {}
_CURRENT: list[str] = [""]


def _constant(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return _CONSTANTS.get(_CURRENT[0], {}).get(node.id)
    if isinstance(node, ast.Attribute):
        values = {c[node.attr] for c in _CONSTANTS.values() if node.attr in c}
        return values.pop() if len(values) == 1 else None
    return None


def _placeholder(node: ast.expr) -> str:
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "did_you_mean":
        return " (did you mean '…'?)"
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "str" and node.args:
        return _placeholder(node.args[0])
    if _constant(node) is not None:
        return _constant(node)
    if isinstance(node, (ast.Name, ast.Attribute)):
        return f"<{ast.unparse(node)}>"
    if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
        return f"<{ast.unparse(node)}>"
    return "…"


def render(node: ast.expr | None) -> str:
    """The text a string expression produces, run-time parts as placeholders."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if not isinstance(value, ast.FormattedValue):
                parts.append(render(value))
            elif isinstance(value.value, ast.Constant):
                parts.append(str(value.value.value))
            else:
                parts.append(_placeholder(value.value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return render(node.left) + render(node.right)
    return _placeholder(node)


def _python_of_smk(text: str) -> str:
    """The plain-Python top-level blocks (imports, functions) of a Snakemake file."""
    keep, block = [], []
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith(("#", ")", "]", "}")):
            if block and block[0].startswith(("def ", "import ", "from ")):
                keep.extend(block)
            block = []
        block.append(line)
    if block and block[0].startswith(("def ", "import ", "from ")):
        keep.extend(block)
    return "\n".join(keep)


def _trees(repo: Path) -> dict[str, ast.Module]:
    files = sorted((repo / "echelon3").rglob("*.py")) + sorted(
        (repo / "workflow" / "scripts").glob("*.py")) + sorted(
        (repo / "workflow" / "rules").glob("*.smk"))
    trees = {}
    for path in files:
        text = path.read_text()
        if path.suffix == ".smk":
            text = _python_of_smk(text)
        trees[str(path.relative_to(repo))] = ast.parse(text)
    return trees


def _collect_constants(trees: dict[str, ast.Module]) -> None:
    _CONSTANTS.clear()
    for source, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper() and \
                    isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                _CONSTANTS.setdefault(source, {})[node.targets[0].id] = node.value.value


def user_error_classes(trees: dict[str, ast.Module]) -> set[str]:
    """``UserError`` and every class derived from it, across all scanned files."""
    names, grew = {ROOT_ERROR}, True
    while grew:
        grew = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names and any(
                        ast.unparse(b).rsplit(".", 1)[-1] in names for b in node.bases):
                    names.add(node.name)
                    grew = True
    return names


STOP_WORKFLOW = "config_error"  # the workflow's one-line stop (workflow/rules/checks.smk)


def _functions(tree: ast.Module):
    """(qualified name, class name or None, function node) for every function."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", node.name, item


def _classify(source: str, kind: str, args: list[ast.expr], cls: str | None, function: str,
              user_errors: set[str]) -> tuple[str, int | None] | None:
    """(text the user reads, exit code) for one raise, or None if it is not the user's."""
    if kind in user_errors:
        key, message = (args + [None, None])[:2]
        if message is None:  # UserError(message) style
            key, message = None, key
        head = "" if isinstance(key, ast.Constant) and key.value is None else render(key)
        return f"echelon3: error: {head + ': ' if head else ''}{render(message)}", 2
    if kind == "WorkerFailed":
        return f"echelon3: {render(args[0] if args else None)}", None
    if source.startswith("workflow/"):
        if kind == STOP_WORKFLOW:
            return render(args[0] if args else None), 1
        if kind in ("WorkflowError", "ValueError"):
            return f"{kind}: {render(args[0] if args else None)}", 1
        return None
    if kind in PLAIN_ERRORS:
        message = render(args[0] if args else None)
        if cls is not None and function.endswith(".__init__"):
            return f"echelon3: error: <section>: {cls} rejected its arguments: {message}", 2
        return f"{kind}: {message}", 1
    return None


def _raised(node: ast.AST, user_errors: set[str]):
    """Calls that make an error the user sees: any construction of a user error (it may
    be returned by a helper and raised elsewhere), other exceptions where raised."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and ast.unparse(sub.func).rsplit(".", 1)[-1] in \
                user_errors | {"WorkerFailed", STOP_WORKFLOW}:
            yield sub
        elif isinstance(sub, ast.Raise) and isinstance(sub.exc, ast.Call) and \
                ast.unparse(sub.exc.func).rsplit(".", 1)[-1] not in user_errors:
            yield sub.exc


def scan(repo: Path) -> list[Site]:
    """Every user-facing message, in file order, duplicates merged."""
    trees = _trees(repo)
    _collect_constants(trees)
    user_errors = user_error_classes(trees)
    sites: dict[tuple[str, str], Site] = {}
    for source, tree in trees.items():
        _CURRENT[0] = source
        for function, cls, node in _functions(tree):
            for call in _raised(node, user_errors):
                kind = ast.unparse(call.func).rsplit(".", 1)[-1]
                found = _classify(source, kind, list(call.args), cls, function, user_errors)
                if found is None:
                    continue
                text, code = found
                site = sites.setdefault((source, text), Site(source, kind, text, code))
                if function not in site.places:
                    site.places.append(function)
    return list(sites.values())


def module_summaries(repo: Path) -> dict[str, str]:
    """First line of each scanned file's docstring (a plain comment for .smk files)."""
    summaries = {}
    for source, tree in _trees(repo).items():
        doc = ast.get_docstring(tree) or ""
        summaries[source] = doc.strip().splitlines()[0] if doc.strip() else ""
    return summaries

"""Key tables of the Configuration and Workflow pages, read from the code itself.

- root keys: ``echelon3.config.compose.ROOT_KEYS``; defaults from the code's
  ``cfg.get("key", default)`` reads; "required by" from its ``require(...)`` calls;
- ``trainer.config``: ``echelon3.tasks.train.RUNTIME_KEYS`` and the keyword settings of
  the built-in ``Trainer`` (its signature less what ``train`` injects);
- ``target``, ``evaluator``, ``runner``: the built-in classes' signatures;
- ``dataloaders.*.config``: the keys ``echelon3.data.loaders.create_dataloader`` reads;
- the workflow's ``config/config.yaml``: its JSON schema.

What each key means is written in ``keys.yaml`` beside this file.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

MEANINGS = Path(__file__).with_name("keys.yaml")
ABSENT = object()


class Undescribed(Exception):
    """A key the code has and keys.yaml does not describe (or the other way round)."""


def literal(value: Any) -> str:
    """A default as it is written in YAML."""
    if value is ABSENT or value is inspect.Parameter.empty:
        return "required"
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return f"`{text.removesuffix('...').strip()}`"


def _parse(repo: Path, relative: str) -> ast.Module:
    return ast.parse((repo / relative).read_text())


def _calls(tree: ast.AST) -> Iterable[ast.Call]:
    return (n for n in ast.walk(tree) if isinstance(n, ast.Call))


def _default_expr(node: ast.Call, parents: dict) -> ast.expr | None:
    """The default of ``x.get("k", d)``, or of ``x.get("k") or d``."""
    if len(node.args) > 1:
        return node.args[1]
    parent = parents.get(node)
    if isinstance(parent, ast.BoolOp) and isinstance(parent.op, ast.Or) and \
            parent.values[0] is node:
        return parent.values[1]
    return None


def reads(tree: ast.AST, receivers: tuple[str, ...],
          methods=("get", "pop", "setdefault")) -> dict[str, ast.expr | None]:
    """``{key: default expression}`` of every ``receiver.get("key", ...)`` in ``tree``."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: dict[str, ast.expr | None] = {}
    for call in _calls(tree):
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr in methods and
                ast.unparse(func.value) in receivers and call.args and
                isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
            continue
        default = _default_expr(call, parents)
        if found.get(call.args[0].value) is None:
            found[call.args[0].value] = default
    return found


def _default_text(expr: ast.expr | None) -> str:
    if expr is None:
        return "—"
    try:
        return literal(ast.literal_eval(expr))
    except ValueError:
        return f"`{ast.unparse(expr)}`"


def required_by(repo: Path) -> dict[str, list[str]]:
    """Section -> tasks whose ``require(cfg, ..., task=...)`` names it."""
    needed: dict[str, list[str]] = {}
    for task in ("train", "evaluate", "run"):
        for call in _calls(_parse(repo, f"echelon3/tasks/{task}.py")):
            if getattr(call.func, "id", "") != "require":
                continue
            named = [k.value.value for k in call.keywords
                     if k.arg == "task" and isinstance(k.value, ast.Constant)]
            if named and named[0] != task:
                continue  # another command's requirement (finetune's init_from)
            for arg in call.args[1:]:
                if isinstance(arg, ast.Constant):
                    needed.setdefault(arg.value, []).append(task)
    return needed


def built_in_defaults(repo: Path) -> dict[str, str]:
    """Section -> its built-in ``module.Type`` from ``with_default_type(...)`` calls."""
    found = {}
    for path in sorted((repo / "echelon3").rglob("*.py")):
        for call in _calls(ast.parse(path.read_text())):
            if getattr(call.func, "attr", getattr(call.func, "id", "")) == "with_default_type" \
                    and len(call.args) == 4 and all(isinstance(a, ast.Constant)
                                                    for a in call.args[1:]):
                section, module, type_ = (a.value for a in call.args[1:])
                found[section] = f"`{module}.{type_}`"
    return found


def injected_into_trainer(repo: Path) -> set[str]:
    """Keyword names ``train`` passes to ``build_trainer`` (runtime objects, not settings)."""
    for call in _calls(_parse(repo, "echelon3/tasks/train.py")):
        if getattr(call.func, "attr", "") == "build_trainer":
            return {k.arg for k in call.keywords if k.arg and k.arg != "runtime_keys"}
    raise Undescribed("echelon3/tasks/train.py no longer calls components.build_trainer")


def signature_defaults(target: Callable, skip: Iterable[str] = ()) -> dict[str, Any]:
    skip = set(skip)
    return {p.name: p.default for p in inspect.signature(target).parameters.values()
            if p.name not in skip and p.name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _meaning(meanings: dict, section: str, key: str, missing: list[str]) -> str:
    text = (meanings.get(section) or {}).get(key)
    if text is None:
        missing.append(f"{section}.{key}")
        return ""
    return text


def _check_stale(meanings: dict, section: str, keys: Iterable[str], missing: list[str]) -> None:
    for key in set(meanings.get(section) or {}) - set(keys):
        missing.append(f"{section}.{key} (described, but the code has no such key)")


def _root_rows(repo: Path, meanings: dict, missing: list[str]) -> list[tuple[str, ...]]:
    from echelon3.config.compose import ROOT_KEYS

    defaults: dict[str, ast.expr | None] = {}
    for path in sorted((repo / "echelon3").rglob("*.py")):
        for key, expr in reads(ast.parse(path.read_text()), ("cfg", "rc.cfg")).items():
            if key in ROOT_KEYS and defaults.get(key) is None:
                defaults[key] = expr
    needed, built_in = required_by(repo), built_in_defaults(repo)
    rows = []
    for key in ROOT_KEYS:
        # A section some task requires has no default worth showing (`or {}` in a reader).
        default = built_in.get(key) or ("—" if key in needed else _default_text(defaults.get(key)))
        tasks = ", ".join(needed.get(key, [])) or "—"
        rows.append((f"`{key}`", default, tasks, _meaning(meanings, "root", key, missing)))
    _check_stale(meanings, "root", ROOT_KEYS, missing)
    return rows


def _keyword_rows(section: str, defaults: dict[str, Any], meanings: dict,
                  missing: list[str]) -> list[tuple[str, ...]]:
    _check_stale(meanings, section, defaults, missing)
    return [(f"`{key}`", literal(default), _meaning(meanings, section, key, missing))
            for key, default in defaults.items()]


def _trainer_defaults(repo: Path) -> dict[str, Any]:
    from echelon3.tasks.train import RUNTIME_KEYS
    from echelon3.trainers.baseline import Trainer

    return {**RUNTIME_KEYS, **signature_defaults(Trainer, injected_into_trainer(repo))}


def _loader_defaults(repo: Path) -> tuple[dict[str, str], list[str]]:
    """(key -> default text, keys echelon3 sets itself) of ``create_dataloader``."""
    tree = _parse(repo, "echelon3/data/loaders.py")
    function = next(n for n in ast.walk(tree)
                    if isinstance(n, ast.FunctionDef) and n.name == "create_dataloader")
    found = {key: ("`true` for `train`, unused for test loaders"
                   if isinstance(expr, ast.Name) and expr.id == "train" else _default_text(expr))
             for key, expr in reads(function, ("config",)).items()}
    injected = next(ast.literal_eval(n.iter) for n in ast.walk(function)
                    if isinstance(n, ast.For) and getattr(n.target, "id", "") == "injected")
    return found, list(injected)


def _workflow_rows(repo: Path) -> list[tuple[str, ...]]:
    schema = yaml.safe_load((repo / "workflow/schemas/config.schema.yaml").read_text())
    defs = schema["$defs"]

    def resolve(node: dict) -> dict:
        ref = node.get("$ref")
        return {**defs[ref.rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}} \
            if ref else node

    rows: list[tuple[str, ...]] = []

    def walk(node: dict, prefix: str, required: Iterable[str] = ()) -> None:
        for key, child in (node.get("properties") or {}).items():
            child = resolve(child)
            name = f"{prefix}{key}"
            default = "required" if key in required else literal(child.get("default", None))
            if "properties" in child:
                if child.get("description"):
                    rows.append((f"`{name}`", default, " ".join(child["description"].split())))
                walk(child, f"{name}.", child.get("required", ()))
            else:
                rows.append((f"`{name}`", default, " ".join(child.get("description", "").split())))
    walk(schema, "")
    walk(defs["experiment"], "experiments.<name>.", defs["experiment"].get("required", ()))
    shared = set(defs["experiment"]["properties"])
    rows += [(f"`sweeps.<name>.{key}`", "as for an experiment", "As for an experiment.")
             for key in defs["sweep"]["properties"] if key in shared]
    only_sweep = {k: v for k, v in defs["sweep"]["properties"].items() if k not in shared}
    walk({"properties": only_sweep}, "sweeps.<name>.", defs["sweep"].get("required", ()))
    return [(key, default, meaning.replace("<", "&lt;")) for key, default, meaning in rows]


def render_tables(repo: Path) -> dict[str, str]:
    """Region name -> Markdown table."""
    from echelon3.checkpoints.files import CheckpointManager
    from echelon3.tasks.evaluate import Evaluator
    from echelon3.tasks.run import Runner

    meanings = yaml.safe_load(MEANINGS.read_text())
    missing: list[str] = []
    loader_defaults, loader_injected = _loader_defaults(repo)
    _check_stale(meanings, "dataloaders", loader_defaults, missing)
    loader_rows = [(f"`{k}`", d, _meaning(meanings, "dataloaders", k, missing))
                   for k, d in loader_defaults.items()]
    loader_rows += [(f"`{k}`", "set by echelon3", "Not allowed in the config.")
                    for k in loader_injected]
    three = ("key", "default", "meaning")
    tables = {
        "root-keys": table(_root_rows(repo, meanings, missing),
                           ("key", "default", "required by", "meaning")),
        "trainer-keys": table(_keyword_rows("trainer", _trainer_defaults(repo), meanings,
                                            missing), three),
        "target-keys": table(_keyword_rows("target", signature_defaults(CheckpointManager),
                                           meanings, missing), three),
        "dataloader-keys": table(loader_rows, three),
        "evaluator-keys": table(_keyword_rows("evaluator", signature_defaults(
            Evaluator, ("path",)), meanings, missing), three),
        "runner-keys": table(_keyword_rows("runner", signature_defaults(Runner, ("path",)),
                                           meanings, missing), three),
        "workflow-keys": table(_workflow_rows(repo), three),
    }
    if missing:
        raise Undescribed("tools/gendocs/keys.yaml is out of step with the code:\n"
                          + "".join(f"  {m}\n" for m in missing))
    return tables

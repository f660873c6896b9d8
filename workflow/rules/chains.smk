"""Helpers of finetune.smk and export.smk: which experiment starts from which
(`init_from`, cycles refused) and which exports what (`export`); sweeps pass
both keys to every point."""


def _points(section, name):
    """The experiments a config entry makes: itself, or every point of a sweep."""
    if section == "experiments":
        return [name]
    return [exp for exp in EXPERIMENTS if exp.startswith(f"{name}/")]


def _parents(cfg):
    """experiment -> the experiment it starts from (sweeps: every point)."""
    parents = {}
    for section in ("experiments", "sweeps"):
        for name, spec in cfg[section].items():
            parent = spec.get("init_from")
            if parent is None:
                continue
            if parent not in EXPERIMENTS:
                config_error(
                    f"{CONFIG_FILE}: {section}.{name}.init_from: no experiment named "
                    f"'{parent}' (experiments: {', '.join(sorted(EXPERIMENTS))})"
                )
            parents.update(dict.fromkeys(_points(section, name), parent))
    return parents


def _refuse_cycles(parents):
    for start in parents:
        chain = [start]
        while chain[-1] in parents:
            chain.append(parents[chain[-1]])
            if chain[-1] in chain[:-1]:
                loop = chain[chain.index(chain[-1]) :]
                config_error(
                    f"{CONFIG_FILE}: init_from makes a cycle: {' -> '.join(loop)}; "
                    "an experiment cannot start from its own descendants"
                )


PARENTS = _parents(config)
_refuse_cycles(PARENTS)
CHILDREN = "|".join(re.escape(name) for name in PARENTS) or "(?!)"


def parent_best(wildcards):
    return f"results/{PARENTS[wildcards.exp]}/best.tar"


def finetune_overrides(wildcards):
    """The experiment's overrides, then the parent's weights to start from."""
    return [*overrides(wildcards), f"init_from.checkpoint={parent_best(wildcards)}"]


EXPORT_FILES = {"onnx": "model.onnx", "safetensors": "model.safetensors"}


def _exports(cfg):
    """experiment -> the formats it exports (sweeps: every point)."""
    formats = {}
    for section in ("experiments", "sweeps"):
        for name, spec in cfg[section].items():
            wanted = spec.get("export", False)
            wanted = ["onnx"] if wanted is True else list(wanted or [])
            if wanted:
                formats.update(dict.fromkeys(_points(section, name), wanted))
    return formats


EXPORTS = _exports(config)


def export_targets():
    return [
        f"results/{exp}/{EXPORT_FILES[fmt]}"
        for exp, formats in EXPORTS.items()
        for fmt in formats
    ]


def exported_model(exp):
    """The ONNX file the leaderboard links, or None."""
    return f"results/{exp}/model.onnx" if "onnx" in EXPORTS.get(exp, []) else None

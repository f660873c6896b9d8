"""Checks of config/config.yaml made before any job is planned. Each problem
stops the workflow with one line that names the key at fault (config_error)."""

from pathlib import Path

import jsonschema
import yaml
from omegaconf import OmegaConf
from snakemake.logging import logger
from snakemake.utils import validate

from echelon3.config.compose import flatten, load_config
from echelon3.config.errors import UserError, did_you_mean

_MISSING = object()

CONFIG_FILE = ", ".join(map(str, workflow.configfiles)) or "config"


def config_error(message):
    """Stop with `message` alone. Snakemake prints an exception raised while it reads
    the Snakefile with the Snakefile's frames (`File "Snakefile", line 16, ...`),
    whatever its class; a mistake in the user's config is better told in one line."""
    logger.error(message)
    raise SystemExit(1)


def _dotted(path):
    """deque(['experiments', 'x', 'overrides', 0]) -> 'experiments.x.overrides[0]'."""
    key = ""
    for part in path:
        if isinstance(part, int):
            key += f"[{part}]"
        else:
            key += f".{part}" if key else str(part)
    return key


def _schema_problem(error):
    """(key, message) of one jsonschema error, in the words of config/README.md."""
    where = _dotted(error.absolute_path)
    if error.validator == "additionalProperties" and error.validator_value is False:
        known = list(error.schema.get("properties", {}))
        unknown = [k for k in error.instance if k not in known]
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        return key, (
            f"unknown key{did_you_mean(unknown[0], known)}; "
            f"known here: {', '.join(known)}"
        )
    if error.validator == "required":
        return where or "(top level)", error.message
    if error.validator == "propertyNames":
        return f"{where}.{error.instance}", error.message
    return where or "(top level)", error.message


def check_schema(cfg, schema_file):
    """The first schema violation as one line, then Snakemake's own validation,
    which fills in the defaults."""
    with open(schema_file) as f:
        schema = yaml.safe_load(f)
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(cfg))
    if error is not None:
        key, problem = _schema_problem(error)
        config_error(f"{CONFIG_FILE}: {key}: {problem}")
    validate(cfg, schema_file)


def check_config_files(cfg):
    """Every experiment and sweep names a config file that exists."""
    folder = Path(cfg["config_dir"])
    if not folder.is_dir():
        config_error(f"{CONFIG_FILE}: config_dir: no folder {folder}")
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    for section in ("experiments", "sweeps"):
        for name, spec in cfg[section].items():
            if not (folder / f"{spec['config']}.yaml").is_file():
                config_error(
                    f"{CONFIG_FILE}: {section}.{name}.config: "
                    f"no file {folder / spec['config']}.yaml"
                    f"{did_you_mean(spec['config'], names)}; "
                    f"configs in {folder}: {', '.join(names) or 'none'}",
                )


def check_sweep_keys(cfg):
    """Every grid key of a sweep names a key its composed config has (after the
    sweep's own overrides, which may add one with +key=...)."""
    for name, sweep in cfg["sweeps"].items():
        try:
            composed = load_config(
                cfg["config_dir"], sweep["config"], sweep["overrides"]
            ).cfg
        except UserError as e:
            config_error(f"{CONFIG_FILE}: sweeps.{name}: {sweep['config']}: {e}")
        leaves = list(flatten(OmegaConf.to_container(composed, resolve=False)))
        for key in sweep["grid"]:
            if OmegaConf.select(composed, key, default=_MISSING) is _MISSING:
                config_error(
                    f"{CONFIG_FILE}: sweeps.{name}.grid.{key}: "
                    f"{sweep['config']} has no key '{key}'"
                    f"{did_you_mean(key, leaves)}; add it with an override "
                    f"'+{key}=...' in sweeps.{name}.overrides if it is new",
                )


# The SLURM profile ships these; every run with them, dry runs too, says so.
PLACEHOLDERS = {"slurm_account": "my_account", "slurm_partition": "gpu"}


def warn_placeholder_slurm_settings():
    """Warn when default-resources still hold profiles/slurm's placeholders
    (the account is the sure sign: no site is called 'my_account')."""
    resources = workflow.resource_settings.default_resources
    account = resources.get("slurm_account") if resources is not None else None
    if account is None or account.raw != PLACEHOLDERS["slurm_account"]:
        return
    partition = resources.get("slurm_partition")
    held = [f"slurm_account '{account.raw}'"]
    if partition is not None and partition.raw == PLACEHOLDERS["slurm_partition"]:
        held.append(f"slurm_partition '{partition.raw}'")
    logger.warning(
        f"profiles/slurm: default-resources still hold the placeholders "
        f"{' and '.join(held)}; set your site's in profiles/slurm/config.yaml, or "
        "add a profile of your own after it (--profile profiles/slurm --profile "
        "my-site), see config/README.md"
    )

"""Helpers shared by the rules: the experiment table, inputs, params, resources.
CONFIG_FILE comes from checks.smk, included before."""

import functools
import itertools
import keyword
import os
import re
import shlex
from copy import deepcopy
from pathlib import Path

import pandas as pd
import yaml
from snakemake.utils import Paramspace

CONFIG_DIR = Path(config["config_dir"])

# Locks GPU ids for a job when Snakemake runs jobs side by side on one machine.
GPU_LOCK = os.path.relpath(Path(workflow.current_basedir) / "../scripts/gpu_lock.py")

# torchrun's rendezvous: the batch script of a SLURM job runs on the first node
# of its allocation, so that node's name is the endpoint; the port is spread by
# job id so that jobs sharing a node do not collide, and a resubmitted job (a
# new id) never meets the remains of the last attempt.
RDZV_ENDPOINT = "$(hostname):$((29500 + SLURM_JOB_ID % 20000))"

# torchrun's agent catches these and passes them on to its workers, then waits
# for them: SIGTERM (preemption, scancel, wall time) and the early-warning
# signal the profile asks SLURM for (--signal=USR1@...). Without USR1 here the
# agent would die of it. (PET_* is how torchrun reads its options from the
# environment; an older torchrun ignores it.)
TORCHRUN_SIGNALS = "PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


# --- the experiment table -----------------------------------------------------


def _format_value(value):
    """A grid value as the CLI's dotlist grammar reads it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _sweep_experiments(sweep_name, sweep):
    """One experiment per point of the sweep's grid, named by Paramspace."""
    keys = list(sweep["grid"])
    labels = [key.rsplit(".", 1)[-1] for key in keys]
    seen = {}
    for key, label in zip(keys, labels):
        where = f"{CONFIG_FILE}: sweeps.{sweep_name}.grid"
        if label in seen:
            config_error(
                f"{where}: '{seen[label]}' and '{key}' both end in '{label}', "
                "which names the experiments; sweep them in two sweeps",
            )
        if keyword.iskeyword(label):
            config_error(f"{where}: '{key}' ends in a Python keyword")
        seen[label] = key
    points = pd.DataFrame(
        list(itertools.product(*sweep["grid"].values())), columns=labels, dtype=object
    )
    space = Paramspace(points, filename_params="*")
    for instance, row in zip(space.instance_patterns, points.itertuples(index=False)):
        grid_overrides = [f"{k}={_format_value(v)}" for k, v in zip(keys, row)]
        yield f"{sweep_name}/{instance}", {
            "config": sweep["config"],
            "overrides": list(sweep["overrides"]) + grid_overrides,
            "resources": deepcopy(sweep["resources"]),
            "sweep": sweep_name,
            "point": dict(zip(labels, row)),
        }


def _check_launcher(where, resources):
    """`launcher: srun` makes one SLURM task per GPU, or per node on the CPU."""
    if resources["launcher"] != "srun":
        return
    if resources["gpus"] < 1 and resources["nodes"] < 2:
        config_error(
            f"{CONFIG_FILE}: {where}.resources.launcher: srun starts one task per GPU (one "
            "per node on the CPU); set resources.gpus to 1 or more, or resources.nodes "
            "to 2 or more, or drop the launcher"
        )


def _experiments(cfg):
    experiments = {
        name: {
            "config": spec["config"],
            "overrides": list(spec["overrides"]),
            "resources": deepcopy(spec["resources"]),
        }
        for name, spec in cfg["experiments"].items()
    }
    for sweep_name, sweep in cfg["sweeps"].items():
        if sweep_name in experiments:
            config_error(
                f"{CONFIG_FILE}: sweeps.{sweep_name}: "
                "an experiment has the same name; rename one of them",
            )
        experiments.update(_sweep_experiments(sweep_name, sweep))
    for section in ("experiments", "sweeps"):
        for name, spec in cfg[section].items():
            _check_launcher(f"{section}.{name}", spec["resources"])
    if not experiments:
        config_error(
            f"{CONFIG_FILE}: experiments: none listed; "
            "list at least one under 'experiments:' or 'sweeps:'"
        )
    return experiments


EXPERIMENTS = _experiments(config)


wildcard_constraints:
    exp="|".join(re.escape(name) for name in EXPERIMENTS),


# --- targets --------------------------------------------------------------------


def results(pattern):
    """`pattern` (with {exp}) for every experiment."""
    return expand(pattern, exp=EXPERIMENTS)


def all_targets():
    return [
        *results("results/{exp}/metrics.json"),
        *results("results/{exp}/predictions.csv"),
        "results/leaderboard.csv",
        "results/leaderboard.md",
        "results/leaderboard.html",
        *results("results/plots/curves/{exp}.png"),
        "results/plots/metrics.png",
        *expand("results/plots/sweeps/{sweep}.png", sweep=config["sweeps"]),
        *export_targets(),  # chains.smk
    ]


# --- inputs ---------------------------------------------------------------------


def _composed_files(name, seen):
    """The config file `name` and those its `defaults:` list pulls in, so that an
    edit to any of them reruns the experiment. Missing defaults are left to the
    CLI to report."""
    path = CONFIG_DIR / f"{name}.yaml"
    if path in seen:
        return []
    seen.add(path)
    files = [str(path)]
    if not path.is_file():
        return files
    data = yaml.safe_load(path.read_text())
    defaults = data.get("defaults") if isinstance(data, dict) else None
    for entry in defaults or []:
        if isinstance(entry, dict):
            names = [
                f"{group.split()[-1]}/{option}"
                for group, option in entry.items()
                if option is not None
            ]
        elif entry == "_self_":
            names = []
        else:
            names = [str(entry)]
        for included in names:
            files += [f for f in _composed_files(included, seen) if Path(f).is_file()]
    return files


def experiment_config(wildcards):
    """The experiment's own echelon3 config file."""
    return str(CONFIG_DIR / f"{EXPERIMENTS[wildcards.exp]['config']}.yaml")


@functools.cache
def _composed_by(name):
    """`_composed_files` once per config name: a sweep shares one config across many
    experiments, and reading the YAML per job made the DAG grow slow."""
    return tuple(_composed_files(name, set())[1:])


def composed_configs(wildcards):
    """Config files the experiment's config composes (its defaults list)."""
    return list(_composed_by(EXPERIMENTS[wildcards.exp]["config"]))


# --- params ---------------------------------------------------------------------


def overrides(wildcards):
    """The experiment's CLI overrides; a change to them reruns its jobs."""
    return EXPERIMENTS[wildcards.exp]["overrides"]


def config_dir(wildcards, input):
    return str(Path(input.config).parent)


def config_name(wildcards, input):
    return Path(input.config).stem


def target_dir(wildcards, output):
    """The run's target.path: the folder of the rule's first output."""
    return str(Path(output[0]).parent)


def launch(wildcards, resources):
    """Command prefix that starts echelon3 on what the job was given: srun
    alone (`launcher: srun`, every task one rank), torchrun under srun across
    nodes, or a GPU lock around the echelon3 launcher on one node (a no-op
    prefix on the CPU), after the experiment's names for MLflow's tags. Derived
    from resources, so a change of resources alone does not rerun a job."""
    names = tracking_names(wildcards)
    if resources.get("mpi"):
        res = EXPERIMENTS[wildcards.exp]["resources"]
        if res["launcher"] == "srun":
            return f"{names} {resources.mpi}"
        return (
            f"{names} {TORCHRUN_SIGNALS} {resources.mpi} torchrun --nnodes {res['nodes']}"
            f" --nproc_per_node {max(res['gpus'], 1)}"
            f" --rdzv_backend c10d --rdzv_endpoint {RDZV_ENDPOINT}"
            " --rdzv_id $SLURM_JOB_ID --no-python"
        )
    if resources.get("gpu"):
        return f"{names} {GPU_LOCK} {resources.gpu} --"
    return names


def tracking_names(wildcards):
    """ECHELON3_EXPERIMENT (and ECHELON3_SWEEP) for the command: the MLflow run's name
    and tags, and a sweep's shared MLflow experiment (echelon3.observe.mlflow)."""
    spec = EXPERIMENTS[wildcards.exp]
    names = f"ECHELON3_EXPERIMENT={shlex.quote(wildcards.exp)}"
    if spec.get("sweep"):
        names += f" ECHELON3_SWEEP={shlex.quote(spec['sweep'])}"
    return names


def devices(wildcards, resources):
    """Device overrides matching the job's resources: the GPUs it was given,
    counted inside CUDA_VISIBLE_DEVICES, or the CPU."""
    if resources.get("mpi"):
        # the local rank picks each worker's GPU among those it sees (torchrun's
        # LOCAL_RANK, or the one GPU srun gave the task)
        has_gpus = EXPERIMENTS[wildcards.exp]["resources"]["gpus"] > 0
        return [] if has_gpus else ["device=cpu"]
    if resources.get("gpu"):
        return [f"gpus=[{','.join(str(i) for i in range(resources.gpu))}]"]
    return ["device=cpu"]


# --- resources ------------------------------------------------------------------


def _res(wildcards):
    return EXPERIMENTS[wildcards.exp]["resources"]


def _multinode(wildcards):
    return _res(wildcards)["nodes"] > 1


def _srun_tasks(wildcards):
    """`launcher: srun`: one SLURM task per rank."""
    return _res(wildcards)["launcher"] == "srun"


def _ranks_per_node(wildcards):
    """One rank per GPU, or one per node on the CPU."""
    return max(_res(wildcards)["gpus"], 1)


def nodes(wildcards):
    return _res(wildcards)["nodes"]


def cpus(wildcards):
    return _res(wildcards)["cpus"]


def train_cpus_per_task(wildcards):
    """The node's cpus, split between the tasks when each GPU is a task."""
    res = _res(wildcards)
    if _srun_tasks(wildcards):
        return max(1, res["cpus"] // _ranks_per_node(wildcards))
    return res["cpus"]


def mem_mb(wildcards):
    return _res(wildcards)["mem_mb"]


def runtime(wildcards):
    return _res(wildcards)["runtime"]


def train_gpus(wildcards):
    """GPUs on one node (the SLURM plugin's `gpu` -> --gpus); None across nodes."""
    if _multinode(wildcards):
        return None
    return _res(wildcards)["gpus"] or None


def one_gpu(wildcards):
    """evaluate and run use at most one GPU."""
    return min(_res(wildcards)["gpus"], 1) or None


def train_gres(wildcards):
    """GPUs per node across nodes (--gres=gpu:G is per node, --gpus is not)."""
    res = _res(wildcards)
    if res["nodes"] > 1 and res["gpus"]:
        return f"gpu:{res['gpus']}"
    return None


def train_tasks(wildcards):
    """One task per rank (`launcher: srun`), or one per node, each a torchrun."""
    if _srun_tasks(wildcards):
        return _res(wildcards)["nodes"] * _ranks_per_node(wildcards)
    return _res(wildcards)["nodes"] if _multinode(wildcards) else None


def no_tasks_per_gpu(wildcards):
    """0 for GPU jobs: the SLURM plugin would otherwise add --ntasks-per-gpu
    (from `tasks`, or 1 in plugin 2.7), asking for a task per GPU where a job
    has one launcher task per node; 0 leaves it out."""
    return 0 if _res(wildcards)["gpus"] else None


def train_tasks_per_gpu(wildcards):
    """1 with `launcher: srun`: one task per GPU. Unset, the SLURM plugin would
    pass --ntasks-per-gpu=<tasks>, G tasks on every GPU, which leaves the job
    pending for good (reason PartitionConfig). Else as evaluate/run."""
    if _srun_tasks(wildcards) and _res(wildcards)["gpus"]:
        return 1
    return no_tasks_per_gpu(wildcards)


def train_mpi(wildcards):
    """The srun prefix: one task per GPU (`launcher: srun`) or one per node.
    The SLURM plugin runs a job that has an `mpi` resource directly in its
    batch script, so this srun is the job's only step; it restates the step's
    shape because the plugin clears SLURM_*."""
    res = _res(wildcards)
    if _srun_tasks(wildcards):
        per_node = _ranks_per_node(wildcards)
        shape = f"srun --ntasks={res['nodes'] * per_node}"
        if res["nodes"] > 1:
            shape += f" --nodes={res['nodes']} --ntasks-per-node={per_node}"
        if res["gpus"]:
            shape += " --gpus-per-task=1"
        return f"{shape} --cpus-per-task={train_cpus_per_task(wildcards)}"
    if res["nodes"] == 1:
        return None
    gres = f" --gres=gpu:{res['gpus']}" if res["gpus"] else ""
    return (
        f"srun --nodes={res['nodes']} --ntasks={res['nodes']} --ntasks-per-node=1"
        f"{gres} --cpus-per-task={res['cpus']}"
    )

"""One cluster job per experiment: train, evaluate, run and export of an
experiment form one Snakemake job group, `exp_<name>`, which a cluster executor
(profiles/slurm) submits as one job; `snakemake -j1` and other local runs ignore
groups. `one_job_per_experiment: false` in config/config.yaml turns it off, and
so does a `--groups` option that names one of these rules.

Snakemake asks for a group's resources by adding up those of the jobs that could
run side by side and taking the largest of jobs that run one after another
(runtime the other way round). Inside the group's job they run one after
another, after train, on what train was given; so when the group starts with
train still to do, evaluate, run and export ask for nothing of their own there,
and the group's job is train's: its CPUs, GPUs, memory, nodes and wall time.
Inside the job they run in one srun step on all of it, or, where train starts
its own srun (several nodes, `launcher: srun`), in the batch script.

An experiment whose training had already finished when the workflow started
(only evaluate, run or export to do, or train to redo after an edit) keeps one
job per rule with its own resources. A group submitted again (`retries`) keeps
its jobs and train's resources, even when train finished in the first attempt.
"""

EXPERIMENT_RULES = ("train", "finetune", "evaluate", "run", "export")


def _groups_overridden():
    """A `--groups` option naming one of the rules: the user's groups apply."""
    overrides = workflow.group_settings.overwrite_groups or {}
    return any(rule in overrides for rule in EXPERIMENT_RULES)


ONE_JOB_PER_EXPERIMENT = config["one_job_per_experiment"] and not _groups_overridden()


@functools.cache
def _untrained_at_start(exp):
    """Whether the experiment's training was still to finish when this Snakemake
    first asked (summary.json is train's last output): asked once per process,
    so that a group and its resources keep the answer on every attempt."""
    return not Path(f"results/{exp}/summary.json").exists()


def experiment_group(wildcards):
    """`exp_<name>` (a sweep point's slash as '_'), or no group."""
    if ONE_JOB_PER_EXPERIMENT and _untrained_at_start(wildcards.exp):
        return f"exp_{wildcards.exp.replace(os.sep, '_')}"
    return None


def _rides_with_train(wildcards):
    """True where Snakemake sums up a group to run it as one: the process that
    submits it, and the one inside the cluster job that starts it as one step
    (both use a cluster executor), for a job in its experiment's group. The
    Snakemake that then runs the jobs one by one executes locally and gives each
    its own resources."""
    return workflow.non_local_exec and experiment_group(wildcards) is not None


def own_share(resource):
    """`resource` of evaluate / run / export, or 0 while the job rides in its
    experiment's group on train's resources (None, unset, stays unset)."""

    def share(wildcards):
        value = resource(wildcards) if callable(resource) else resource
        if value is not None and _rides_with_train(wildcards):
            return 0
        return value

    share.__name__ = getattr(resource, "__name__", "constant")
    return share

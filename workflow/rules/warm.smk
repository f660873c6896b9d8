"""`warm_start: true` (the default): where Snakemake runs the jobs on this
machine, `echelon3` hands each command to a server that has torch and echelon3
imported already and forks a copy per job (echelon3/warm/). Every job stays a
Snakemake job of its own: its outputs, log, retries and exit code are unchanged.
The server lives while this Snakemake does. On a cluster the jobs start from
scratch (echelon3 also refuses inside a SLURM job and under torchrun)."""

WARM_ENV = "ECHELON3_WARM"  # set here for the jobs, never read from the user

if config["warm_start"] and not workflow.non_local_exec:
    os.environ[WARM_ENV] = str(os.getpid())
else:
    os.environ.pop(WARM_ENV, None)

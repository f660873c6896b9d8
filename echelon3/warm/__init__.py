"""Warm start: a workflow's jobs skip the imports (most of a small job's start-up).

Where ``ECHELON3_WARM`` names the Snakemake process that runs the workflow (the
Snakefile sets it when jobs run on this machine), ``echelon3`` hands its command
line, working directory, environment and standard streams to a server that has
torch, torchmetrics and echelon3 imported already; the server forks, and the copy
runs the command as if it were the program itself. Each Snakemake job stays a job
of its own (its outputs, log, retries and exit code are Snakemake's as before);
only the imports are shared.

- :mod:`echelon3.warm.client`: the ``echelon3`` program; whether to hand over,
  the hand-over, signals passed on, the exit code passed back.
- :mod:`echelon3.warm.server`: the server and the forked copy that runs a command.
"""

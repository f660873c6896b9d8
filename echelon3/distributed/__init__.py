"""Where and how the work runs: launcher detection and spawning, the process group and rank
helpers, DDP, FSDP, precision, each worker's runtime, preemption and Ctrl-C."""

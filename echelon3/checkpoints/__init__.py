"""Checkpoint files: atomic rank-0 writes, retention, safe loading, sharded (DCP) folders,
the run lock, extending a run."""

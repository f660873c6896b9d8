"""Watching a run: metric loggers (history.jsonl, TensorBoard, MLflow), the bottleneck
report, the profiler."""

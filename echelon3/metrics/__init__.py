"""Metric contract for custom metrics; torchmetrics objects work as they are."""

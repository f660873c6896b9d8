"""Metric loggers behind one small interface (``log``, ``close``); rank 0 only."""

from echelon3.mlops.base import DefaultLogger, JsonlLogger, Logger, NoOpLogger

__all__ = ["DefaultLogger", "JsonlLogger", "Logger", "NoOpLogger"]

"""The trackers of a run (MLflow, W&B), handled as one: each is off unless its root key
is set, and each failure stays its own (one tracker down leaves the other on)."""

from __future__ import annotations

from echelon3.observe.loggers import Logger


class Trackers:
    """``watch``, ``finish`` and ``stopped`` of each tracker, in order."""

    def __init__(self, *trackers):
        self.trackers = trackers

    def watch(self, logger: Logger, resumed: bool, **tags) -> Logger:
        for tracker in self.trackers:
            logger = tracker.watch(logger, resumed=resumed, **tags)
        return logger

    def finish(self, summary: dict | None) -> None:
        for tracker in self.trackers:
            tracker.finish(summary)

    def stopped(self, error: BaseException) -> None:
        for tracker in self.trackers:
            tracker.stopped(error)


def for_task(rc) -> Trackers:
    """The training trackers of ``rc``'s config."""
    from echelon3.observe import mlflow, wandb

    return Trackers(mlflow.for_task(rc), wandb.for_task(rc))

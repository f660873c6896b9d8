"""The training loop, over objects it is handed (built in ``echelon3.train``).

Per step: zero grads, forward under the precision's autocast, the weighted sum
of the configured losses, backward, optimizer step (closure optimizers get a
closure). With ``grad_accum_steps: N`` the optimizer steps every N micro-batches
(``accumulation.py``); ``global_step`` counts optimizer steps. The scheduler
steps once per epoch. ``profile`` runs torch.profiler over a window of batches
(``echelon3/profiling.py``). Validation runs
``times_to_validate_per_epoch`` times per epoch on every rank over its shard,
through the network without its DDP wrapper; metrics reduce across ranks, so
keep-best decides the same on every rank. Only rank 0 writes (checkpoint
manager and logger enforce that).

The hot loop never waits for the device: losses are averaged on the device
between log points and read one log point later (``running.py``); batches are
moved only when the device is not the CPU. Each epoch adds a ``split: time``
record to the history, from :mod:`echelon3.bottleneck`, and the first
steady-state epoch logs it with the lever to pull when the run is input- or
launch-bound.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm  # not tqdm.auto: its asyncio variant opens every loader twice

from echelon3 import preemption
from echelon3.bottleneck import EpochClock, is_compiled
from echelon3.checkpoint import rng_state, set_rng_state, strip_prefixes
from echelon3.data import set_epoch, skip_batches
from echelon3.dist import all_gather_object, get_rank, get_world_size, is_main, unwrap
from echelon3.errors import ConfigError
from echelon3.evaluate import evaluate_sets, metric_name, split_batch, to_device, weighted_loss
from echelon3.profiling import Profiler
from echelon3.runtime import interrupted
from echelon3.samples import naming_bad_labels
from echelon3.trainers.accumulation import Accumulation
from echelon3.trainers.running import RunningLosses
from echelon3.trainers.nonfinite import NonFiniteGuard
from echelon3.trainers.selection import KeepBest

log = logging.getLogger(__name__)

CLOSURE_OPTIMIZERS = ("SAMOptimizer", "LBFGS")
# Keys of every history record; a loss or metric of that name would overwrite one.
RESERVED = ("split", "epoch", "step", "lr")


def is_closure_optimizer(optimizer) -> bool:
    return type(optimizer).__name__ in CLOSURE_OPTIMIZERS


def _check_names(losses: Mapping, metrics: Mapping) -> None:
    taken = (*RESERVED, "loss")
    for section, names in (("loss", losses), ("metrics", metrics)):
        for name in names:
            if name in taken or "/" in name:
                raise ConfigError(f"{section}.{name}", "this name is taken by the history "
                                  f"records ({', '.join(taken)}) or contains '/'; rename it")


class Trainer:
    """Injected: everything but the keyword settings below, which come from ``trainer.config``."""

    def __init__(self, *, net, losses, optimizer, train_loader, test_loaders, metrics,
                 checkpoints, logger, precision, device, scheduler=None, named_sets=False,
                 resume_state=None, extra_state=None, epochs: int = 10,
                 times_to_validate_per_epoch: int = 1,
                 keep_best_on: Any = None, high_is_better: bool = True,
                 metrics_on: str | Sequence[str] | None = None, float_labels: bool = False,
                 log_every_n_steps: int = 50, progress_bar: bool = True,
                 nan_policy: str = "stop", grad_accum_steps: int = 1,
                 profile: Mapping | None = None):
        if int(epochs) < 1 or int(times_to_validate_per_epoch) < 1:
            raise ValueError("epochs and times_to_validate_per_epoch must be at least 1")
        self.net, self.losses, self.optimizer = net, losses, optimizer
        self.scheduler, self.precision, self.device = scheduler, precision, device
        self.train_loader, self.test_loaders, self.metrics = train_loader, test_loaders, metrics
        self.checkpoints, self.logger, self.named_sets = checkpoints, logger, named_sets
        self.epochs, self.validations = int(epochs), int(times_to_validate_per_epoch)
        self.float_labels, self.log_every = float_labels, max(1, int(log_every_n_steps))
        self.progress_bar = progress_bar and is_main()
        self.extra_state = dict(extra_state or {})
        self.closure = is_closure_optimizer(optimizer)
        self.nonfinite = NonFiniteGuard(nan_policy, self.closure)
        self.accum = Accumulation(grad_accum_steps, self.closure)
        self.profiler = Profiler(profile, checkpoints.path)
        sets = [metrics_on] if isinstance(metrics_on, str) else list(metrics_on or test_loaders)
        unknown = [s for s in sets if s not in test_loaders]
        if unknown:
            raise ConfigError("trainer.config.metrics_on", f"unknown test set '{unknown[0]}'; "
                              f"known: {', '.join(test_loaders)}")
        self.metric_sets = sets
        _check_names(losses, metrics)
        self.keep_best = KeepBest(keep_best_on, high_is_better, self.metric_names(),
                                  sets[0] if named_sets else None)
        self.epoch, self.global_step = 0, 0
        self.best_metrics: dict[str, float] | None = None
        self.last_metrics: dict[str, float] = {}
        self._rng = None  # RNG state to restore right before training resumes
        self.move = torch.device(device).type != "cpu"  # batches already sit on the CPU
        single = len(losses) == 1 and next(iter(losses.values()))[1] == 1
        self.running = RunningLosses(["loss", *losses], same_as_total=single)
        self._bar = None
        self._mid = None  # where a preempted epoch resumes (preemption.resume_point)
        self._epoch_rng = None  # RNG states as the epoch in progress began
        if resume_state is not None:
            self.restore(resume_state)

    # ------------------------------------------------------------------ names and state

    def metric_names(self) -> list[str]:
        names = [metric_name(s, "loss", self.named_sets) for s in self.test_loaders]
        names += [metric_name(s, m, self.named_sets) for s in self.metric_sets
                  for m in self.metrics]
        return names

    def state_dict(self) -> dict[str, Any]:
        return {
            "model_state_dict": strip_prefixes(unwrap(self.net).state_dict()),
            "optimizer_state_dict": self.optimizer.state_dict(),
            "scheduler_state_dict": self.scheduler.state_dict() if self.scheduler else None,
            "scaler_state_dict": self.precision.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "metrics": dict(self.last_metrics),
            "best_metrics": dict(self.best_metrics) if self.best_metrics else None,
            "rng_state": rng_state(),  # rank 0's; every rank's below, for exact DDP resume
            "rng_states": all_gather_object(rng_state()) if get_world_size() > 1 else None,
            **self.accum.state_dict(self._params()),
            **self.extra_state,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint (the network weights are loaded by the caller)."""
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        if self.scheduler is not None and state.get("scheduler_state_dict"):
            self.scheduler.load_state_dict(state["scheduler_state_dict"])
        self.precision.load_state_dict(state.get("scaler_state_dict"))
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.best_metrics = state.get("best_metrics")
        self.last_metrics = dict(state.get("metrics") or {})
        per_rank = state.get("rng_states")
        same_world = per_rank is not None and len(per_rank) == get_world_size()
        self._rng = per_rank[get_rank()] if same_world else state.get("rng_state")
        self._mid = preemption.resume_point(state, get_rank(), get_world_size())
        if self._mid is not None:
            self._rng = None  # restored as the preempted epoch restarts
        self.accum.load_state_dict(state, self._params())

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ------------------------------------------------------------------ one step

    def train_step(self, batch, scale: float = 1.0, last: bool = True) -> dict[str, torch.Tensor]:
        """One micro-batch: its loss x ``scale`` backward, and the optimizer step when
        ``last``; ``{"loss": total, name: part, ...}``, detached, on the device."""
        inputs, target = split_batch(batch)
        if self.move:
            inputs, target = to_device((inputs, target), self.device)
        recorded: dict[str, torch.Tensor] = {}

        def forward_backward():
            with self.profiler.label("compute"):
                with self.precision.autocast():
                    total, parts = weighted_loss(self.losses, self.net(inputs), target,
                                                 self.float_labels)
                # No extra multiply (a kernel and an autograd node) when not accumulating.
                self.precision.backward(total * scale if scale != 1 else total)
            if not recorded:
                recorded.update(parts, loss=total)
            return total

        def closure():
            self.optimizer.zero_grad(set_to_none=True)
            return forward_backward()

        if self.closure:
            with self.profiler.label("optimizer"):
                self.precision.step(self.optimizer, closure)
        else:
            with self.accum.sync(self.net, last):
                forward_backward()
            if self.nonfinite.skip(recorded["loss"]):
                self.accum.drop(self.optimizer)  # the window's gradients so far go too
                return {}
            if last:
                with self.profiler.label("optimizer"):
                    self.precision.step(self.optimizer)
                    self.optimizer.zero_grad(set_to_none=True)
        return {k: v.detach() for k, v in recorded.items()}

    # ------------------------------------------------------------------ validation

    def evaluate(self) -> dict[str, float]:
        """Validation through the network without its DDP wrapper, every rank on its shard."""
        net = self.net.module if isinstance(self.net, DistributedDataParallel) else self.net
        return evaluate_sets(net, self.test_loaders, self.metrics, precision=self.precision,
                             device=self.device, losses=self.losses, named_sets=self.named_sets,
                             metric_sets=self.metric_sets, float_labels=self.float_labels,
                             progress=self.progress_bar)

    def validate(self, epoch: int, save_best: bool = True) -> bool:
        """Validate during ``epoch`` (1-based, the epoch in progress or just finished);
        True when keep-best took this result (saved as best.tar if ``save_best``)."""
        self.nonfinite.check()
        metrics = self.evaluate()
        self.last_metrics = metrics
        best = self.keep_best.is_better(metrics, self.best_metrics)
        if best:
            self.best_metrics = dict(metrics)
        self.logger.log({"split": "val", "epoch": epoch, "step": self.global_step, **metrics})
        summary = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        log.info("epoch %d step %d | %s%s", epoch, self.global_step, summary,
                 " | new best" if best else "")
        if best and save_best:
            self.checkpoints.save_best(self.state_dict())
        return best

    # ------------------------------------------------------------------ the loop

    def _log(self, record: dict | None) -> None:
        """Write a finished train record; the progress bar shows its loss."""
        if record is None:
            return
        record["lr"] = self.optimizer.param_groups[0]["lr"]
        self.logger.log(record)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)

    def _train_epoch(self, epoch: int, clock: EpochClock) -> bool:
        """One epoch; True when the profiled window ended the run (``profile.stop_after``)."""
        batches, done = self._start_epoch(epoch)
        self.net.train()
        steps, world = len(self.train_loader), get_world_size()
        validate_at = {round(steps * (k + 1) / self.validations)
                       for k in range(self.validations - 1)}
        # On a GPU one step per log interval runs between CUDA events (none when that would
        # be most steps).
        sample_at = self.log_every // 2 if clock.cuda and self.log_every >= 4 else -1
        self._bar = bar = tqdm(self.profiler.batches(clock.batches(batches)), total=steps,
                               initial=done,
                               desc=f"epoch {epoch + 1}/{self.epochs}",
                               disable=None if self.progress_bar else True, dynamic_ncols=True)
        stopped = False
        for i, batch in enumerate(bar, start=done + 1):
            if interrupted():
                raise KeyboardInterrupt
            scale, last = self.accum.window(i - 1, steps)
            started = clock.step_started()
            with naming_bad_labels(batch, self.metrics):
                if i % self.log_every == sample_at:
                    parts = clock.sample_device(lambda: self.train_step(batch, scale, last))
                else:
                    parts = self.train_step(batch, scale, last)
            clock.step_ended(started)
            self.global_step += int(last)  # counts optimizer steps
            self.nonfinite.observe(epoch + 1, self.global_step, parts)
            self.running.add(parts)
            if i % self.log_every == 0 or i == steps:
                self.nonfinite.check(lagged=True)
                self._log(self.running.close_interval(
                    {"split": "train", "epoch": epoch + 1, "step": self.global_step}))
            if i in validate_at:
                self._log(self.running.finish())
                with clock.aside():
                    self.validate(epoch + 1)
            if preemption.stop_now(world, self.device):
                self._preempt(i)
            stopped = self.profiler.step()
            if stopped:
                log.info("stopping after the profiled batches (trainer.config.profile."
                         "stop_after)")
                break
        self._log(self.running.finish())
        bar.close()
        self._bar = None
        return stopped

    def _start_epoch(self, epoch: int):
        """Set the epoch's data order and open its batches -> (batches, steps done).
        A preempted epoch continues after its last step, with that moment's RNG states
        and unlogged losses; the loader draws its seed from the epoch-start state."""
        set_epoch(self.train_loader, epoch)
        mid, self._mid = self._mid, None
        if mid is not None:
            set_rng_state(mid["epoch_rng"])
            skip_batches(self.train_loader, mid["step"])
        self._epoch_rng = rng_state()
        batches = iter(self.train_loader)
        if mid is None:
            return batches, 0
        set_rng_state(mid["rng"])
        self.running.restore(mid["sums"], self.device)
        return batches, mid["step"]

    def _preempt(self, step: int) -> None:
        """Checkpoint the epoch in progress (every rank takes part) and stop."""
        self._log(self.running.finish())
        state = self.state_dict()
        state["preempted"] = preemption.position(step, self._epoch_rng, *self.running.unlogged())
        path = self.checkpoints.save_preempted(state)
        log.info("%s", preemption.report(self.epoch + 1, self.global_step, path))
        raise preemption.Preempted(str(path))

    def fit(self) -> dict[str, float] | None:
        if self._rng is not None:
            set_rng_state(self._rng)
            self._rng = None
        self.logger.rewind(self.global_step)
        if self.epoch >= self.epochs:
            log.info("nothing to train: %d of %d epochs already done", self.epoch, self.epochs)
        clock = EpochClock(self.device, self.train_loader, compiled=is_compiled(self.net))
        start = self.epoch
        report_after = min(start + 1, self.epochs - 1)  # the first steady-state epoch
        self.profiler.start()
        for epoch in range(self.epoch, self.epochs):
            if self._train_epoch(epoch, clock):
                break
            if self.scheduler is not None:
                self.scheduler.step()
            self.epoch = epoch + 1
            self.nonfinite.end_epoch(self.epoch)
            with clock.aside():
                best = self.validate(self.epoch, save_best=False)
                self.checkpoints.save_checkpoint(self.state_dict(), self.epoch, best=best)
            self._report_time(clock, first=epoch == report_after, warm=epoch > start)
        self.profiler.stop()
        self.checkpoints.ensure_best()
        self.nonfinite.end_fit()
        return self.best_metrics

    def _report_time(self, clock: EpochClock, first: bool, warm: bool) -> None:
        """Where the epoch's time went: in history every epoch, in the log once."""
        report = clock.report()
        self.logger.log({"split": "time", "epoch": self.epoch, "step": self.global_step,
                         **report})
        if warm and report.get("compiles"):
            log.warning("torch.compile recompiled %d time(s) in epoch %d, after warm-up; "
                        "TORCH_LOGS=recompiles says why", report["compiles"], self.epoch)
        if first:
            log.info(clock.summary(self.epoch, report))
            lever = clock.lever(report)
            if lever:
                log.info(lever)

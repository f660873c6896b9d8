"""The training loop, over objects it is handed (built in ``echelon3.tasks.train``).

What happens for each micro-batch, in this order (the one place it is written):

1. Ctrl-C is looked at (a flag; stop here, at a safe point).
2. Forward under the precision's autocast, the weighted sum of the configured
   losses divided by the size of the accumulation window, backward (under DDP's
   ``no_sync`` unless the micro-batch closes its window). A closure optimizer
   (SAMOptimizer, LBFGS) runs its whole step here instead, through a closure.
3. :meth:`Stepping.decide <echelon3.trainers.stepping.Stepping.decide>`: ``wait``
   (window open), ``step`` or ``skip`` (``nan_policy: skip`` and a non-finite
   loss in the window on some rank).
4. When the window closed: ``step``: gradient clipping (fp16: unscaled first),
   the optimizer steps, the EMA of the weights moves; ``skip``: the window's
   gradients are dropped. ``global_step`` counts the window, a per-step
   scheduler steps, and the window's losses go to the non-finite guard and to
   the running means (not when skipped).
5. At a log point (every ``log_every_n_steps`` optimizer steps, and at the end
   of the epoch): one collective starts (losses, non-finite flag, preemption
   flag under DDP) and the previous log point's is read: its train record is
   written, a non-finite loss stops the run, a preemption stops it here.
6. At a validation point (``times_to_validate_per_epoch``, at window ends):
   validation, keep-best and ``best.tar``.
7. One process: a preemption signal stops the run after this micro-batch, even
   inside a window. The checkpoint is written by :meth:`Trainer._preempt`, after
   the non-finite guard has checked what it would save.
8. The profiler counts the micro-batch; ``profile.stop_after`` ends the run at
   the end of a window.

After the epoch a per-epoch scheduler steps, validation runs (on the EMA
weights when on), early stopping looks at it, and the epoch's checkpoint is
written. The hot loop never waits for the device (reads happen one log point
later) and runs no collective outside log points, except DDP's gradient
all-reduce and, under ``nan_policy: skip``, one flag per optimizer step.
Mid-epoch state has one home, :mod:`echelon3.trainers.state`.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch
from tqdm import tqdm  # not tqdm.auto: its asyncio variant opens every loader twice

from echelon3.config.errors import blame
from echelon3.data.batches import split_batch, to_device, weighted_loss
from echelon3.data.rng import restore_for_rank
from echelon3.data.samples import naming_bad_labels
from echelon3.distributed import preemption
from echelon3.distributed.ranks import get_rank, get_world_size, unwrap
from echelon3.distributed.runtime import interrupted
from echelon3.observe.bottleneck import EpochClock, is_compiled
from echelon3.observe.profiler import Profiler
from echelon3.optimizers.closure import is_closure_optimizer
from echelon3.trainers.checkpointing import Checkpointing
from echelon3.trainers.clipping import GradientClipping
from echelon3.trainers.early_stopping import EarlyStopping
from echelon3.trainers.ema import EMA
from echelon3.trainers.logpoint import LogPoint
from echelon3.trainers.nonfinite import NonFiniteGuard
from echelon3.trainers.preempting import Preempting
from echelon3.trainers.running import RunningLosses
from echelon3.trainers.state import EpochPosition, MidEpoch
from echelon3.trainers.stepping import STEP, WAIT, Stepping
from echelon3.trainers.validating import Validation

log = logging.getLogger(__name__)


class Trainer(Checkpointing, Preempting, Validation):
    """Injected: everything but the keyword settings below, which come from ``trainer.config``."""

    def __init__(self, *, net, losses, optimizer, train_loader, test_loaders, metrics,
                 checkpoints, logger, precision, device, scheduler=None, named_sets=False,
                 resume_state=None, extra_state=None, epochs: int = 10,
                 times_to_validate_per_epoch: int = 1,
                 keep_best_on: Any = None, high_is_better: bool = True,
                 metrics_on: str | Sequence[str] | None = None, float_labels: bool = False,
                 log_every_n_steps: int = 50, progress_bar: bool = True,
                 nan_policy: str = "stop", grad_accum_steps: int = 1,
                 profile: Mapping | None = None, scheduler_interval: str = "epoch",
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                 early_stopping: Mapping | None = None, ema: Mapping | None = None):
        if int(epochs) < 1 or int(times_to_validate_per_epoch) < 1:
            raise ValueError("epochs and times_to_validate_per_epoch must be at least 1")
        self.net, self.losses, self.optimizer = net, losses, optimizer
        self.scheduler, self.precision, self.device = scheduler, precision, device
        self.train_loader, self.test_loaders, self.metrics = train_loader, test_loaders, metrics
        self.checkpoints, self.logger, self.named_sets = checkpoints, logger, named_sets
        self.epochs, self.validations = int(epochs), int(times_to_validate_per_epoch)
        self.float_labels, self.log_every = float_labels, max(1, int(log_every_n_steps))
        self.extra_state = dict(extra_state or {})
        self.closure = is_closure_optimizer(optimizer)
        self.nonfinite = NonFiniteGuard(nan_policy, self.closure)
        self.stepping = Stepping(grad_accum_steps, self.nonfinite, precision, self._params,
                                 self.closure)
        self.profiler = Profiler(profile, checkpoints.path)
        self.interval = scheduler_interval
        self.clipping = GradientClipping(gradient_clip_val, gradient_clip_algorithm, precision,
                                         self.closure, device)
        self.ema = EMA(unwrap(net), ema) if ema else None
        self.setup_validation(metrics_on, keep_best_on, high_is_better, progress_bar)
        first = self.keep_best.criteria[0]
        self.early = EarlyStopping(early_stopping, first.name, first.high) \
            if early_stopping else None
        self._lr = optimizer.param_groups[0]["lr"]  # of the last optimizer step
        self.epoch, self.global_step = 0, 0
        self.move = torch.device(device).type != "cpu"  # batches already sit on the CPU
        single = len(losses) == 1 and next(iter(losses.values()))[1] == 1
        self.running = RunningLosses(["loss", *losses], same_as_total=single, device=device)
        self.logpoint = LogPoint()
        self._stop = False  # a rank received a preemption signal (read at a log point)
        self.position = EpochPosition()
        self.mid_epoch = MidEpoch(position=self.position, nonfinite=self.nonfinite,
                                  stepping=self.stepping, running=self.running,
                                  clipping=self.clipping)
        self._bar = None
        self._resume_rng = None  # (every rank's RNG states, rank 0's) to restore at fit
        if resume_state is not None:
            self.restore(resume_state)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ------------------------------------------------------------------ one micro-batch

    def forward_backward(self, batch, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """The micro-batch's losses x ``scale`` backward: ``{"loss": total, name: part}``.
        Under ``loss: from_output`` the wrapped network is called with the target and the
        loss is its own (:class:`echelon3.data.batches.OutputLoss`)."""
        from echelon3.data.batches import call_net  # kept in this method's own lines

        inputs, target = split_batch(batch)
        if self.move:
            inputs, target = to_device((inputs, target), self.device)
        with self.profiler.label("compute"):
            with self.precision.autocast():
                try:  # a loss's error is marked with its own key first
                    out = call_net(self.net, unwrap(self.net), self.losses, inputs, target)
                    total, parts = weighted_loss(self.losses, out, target, self.float_labels)
                except Exception as e:
                    blame(e, "net", "training")
                    raise
            # No extra multiply (a kernel and an autograd node) when not accumulating.
            self.precision.backward(total * scale if scale != 1 else total)
        return {"loss": total.detach(), **{k: v.detach() for k, v in parts.items()}}

    def closure_step(self, batch) -> dict[str, torch.Tensor]:
        """A closure optimizer's whole step; the losses of its first evaluation."""
        recorded: dict[str, torch.Tensor] = {}

        def closure():
            self.optimizer.zero_grad(set_to_none=True)
            parts = self.forward_backward(batch)
            recorded.update(parts if not recorded else {})
            return parts["loss"]

        with self.profiler.label("optimizer"):
            self.precision.step(self.optimizer, closure)
        return recorded

    def micro_batch(self, batch, scale: float, last: bool) -> str:
        """Steps 2-4 of the order above; the decision taken."""
        if self.closure:
            self.stepping.decide(self.closure_step(batch), last=True)
            decision = STEP
        else:
            with self.stepping.sync(self.net, last):
                parts = self.forward_backward(batch, scale)
            decision = self.stepping.decide(parts, last)
            if decision == STEP:
                with self.profiler.label("optimizer"):
                    self.clipping.clip(self.optimizer, self._params())
                    self.precision.step(self.optimizer)
                    self.optimizer.zero_grad(set_to_none=True)
        if decision != WAIT:
            losses = self.stepping.close(self.optimizer, decision)
            self.global_step += 1
            self._after_step(decision)
            self.nonfinite.observe(self.epoch + 1, self.global_step, losses)
            for parts in losses:
                self.running.add(parts)
        return decision

    def _after_step(self, decision: str) -> None:
        """Step 4's end: the EMA moves (a step taken), a per-step scheduler steps."""
        if decision == STEP and self.ema is not None:
            self.ema.update(self.global_step)
        self._lr = self.optimizer.param_groups[0]["lr"]
        if self.interval == "step" and self.scheduler is not None:
            self.scheduler.step()

    # ------------------------------------------------------------------ log points

    def _log_point(self, epoch: int) -> None:
        """Step 5: start this interval's collective, act on the previous one's."""
        means = self.running.take()
        values = {"bad": self.nonfinite.interval_flag(self.device)}
        if get_world_size() > 1:
            values["stop"] = torch.tensor(float(preemption.requested() is not None),
                                          device=self.device)
        if means is not None:
            values["losses"] = means
        norms = self.clipping.take(get_world_size())
        if norms is not None:
            values["grad_norm"] = norms
        record = {"split": "train", "epoch": epoch, "step": self.global_step, "lr": self._lr}
        self._act(self.logpoint.exchange(record if means is not None else None, values))

    def _flush_logs(self) -> None:
        self._act(self.logpoint.flush())

    def _act(self, read) -> None:
        if read is None:
            return
        record, values = read
        self.nonfinite.read(values["bad"][0])
        if record is not None:
            record = self.running.fill(record, values["losses"])
            if "grad_norm" in values:
                record["grad_norm"] = self.clipping.read(values["grad_norm"])
            self.logger.log(record)
            if self._bar is not None:
                self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if values.get("stop", [0])[0] > 0:
            self._stop = True

    # ------------------------------------------------------------------ the loop

    def _train_epoch(self, epoch: int, clock: EpochClock) -> bool:
        """One epoch; True when the profiled window ended the run (``profile.stop_after``)."""
        batches, done = self.position.start(self.train_loader, epoch, get_rank())
        self.net.train()
        steps = len(self.train_loader)
        windows = self.stepping.windows_in(steps)
        validate_at = {round(windows * (k + 1) / self.validations)
                       for k in range(self.validations - 1)}
        # On a GPU one step per log interval runs between CUDA events.
        sample_at = self.log_every // 2 if clock.cuda and self.log_every >= 4 else -1
        self._bar = bar = tqdm(self.profiler.batches(clock.batches(batches)), total=steps,
                               initial=done, desc=f"epoch {epoch + 1}/{self.epochs}",
                               disable=None if self.progress_bar else True, dynamic_ncols=True)
        self._stop, profiled = False, False  # profiled: the profiled window is over
        for i, batch in enumerate(bar, start=done + 1):
            if interrupted():
                raise KeyboardInterrupt
            scale, last = self.stepping.window(i - 1, steps)
            started = clock.step_started()
            with naming_bad_labels(batch, self.metrics):
                if i % self.log_every == sample_at:
                    decision = clock.sample_device(lambda: self.micro_batch(batch, scale, last))
                else:
                    decision = self.micro_batch(batch, scale, last)
            clock.step_ended(started)
            self.position.step = i
            profiled = self.profiler.step() or profiled
            if decision == WAIT:
                if self._stop_requested():
                    self._preempt(epoch)
                continue
            if self.global_step % self.log_every == 0 and i < steps:
                self._log_point(epoch + 1)
            if -(-i // self.stepping.steps) in validate_at:
                with clock.aside():
                    self.validate(epoch + 1)
            if self._stop_requested():
                self._preempt(epoch)
            if profiled:
                log.info("stopping after the profiled batches (trainer.config.profile."
                         "stop_after)")
                break
        self._log_point(epoch + 1)
        self._flush_logs()
        bar.close()
        self._bar = None
        if self._stop:
            self._preempt(epoch)
        return profiled

    def _stop_requested(self) -> bool:
        """Step 7: one process stops on its own signal; ranks on the log point's flag."""
        return self._stop or (get_world_size() == 1 and preemption.requested() is not None)

    def fit(self) -> dict[str, float] | None:
        if self._resume_rng is not None:
            restore_for_rank(*self._resume_rng, get_rank(), get_world_size())
            self._resume_rng = None
        self.logger.rewind(self.global_step)
        if self.stopped_early():
            log.info("nothing to train: %s", self.stopped_early())
        elif self.epoch >= self.epochs:
            log.info("nothing to train: %d of %d epochs already done", self.epoch, self.epochs)
        clock = EpochClock(self.device, self.train_loader, compiled=is_compiled(self.net))
        start = self.epoch
        report_after = min(start + 1, self.epochs - 1)  # the first steady-state epoch
        self.profiler.start()
        for epoch in range(self.epoch, self.epochs if not self.stopped_early() else 0):
            if self._train_epoch(epoch, clock):
                break
            if self.scheduler is not None and self.interval == "epoch":
                self.scheduler.step()
            self.epoch = epoch + 1
            self.nonfinite.end_epoch(self.epoch)
            with clock.aside():
                best = self.validate(self.epoch, save_best=False)
                stop = self.early is not None and self.early.update(self.epoch,
                                                                    self.last_metrics)
                self.checkpoints.save_checkpoint(self.state_dict(), self.epoch, best=best)
            self._report_time(clock, first=epoch == report_after, warm=epoch > start)
            if stop:
                log.info("%s (trainer.config.early_stopping)", self.stopped_early())
                break
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


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
   scheduler steps, every ``gc_every_n_steps``-th step Python's garbage is
   collected (:mod:`echelon3.trainers.collection`: at the same step on every rank,
   never in between), and the window's losses go to the non-finite guard and to
   the running means (not when skipped).
5. At a log point (every ``log_every_n_steps`` optimizer steps, and at the end
   of the epoch): one collective starts (losses, non-finite flag, preemption
   flag under DDP, samples and tokens) and the previous log point's is read: its
   train record is written with its throughput (:mod:`echelon3.trainers.throughput`),
   a non-finite loss stops the run, a preemption stops it here.
6. At a validation point (``times_to_validate_per_epoch``, at window ends, or every
   ``val_check_interval`` optimizer steps: :mod:`echelon3.trainers.length`): validation,
   keep-best and ``best.tar`` (in the step mode, early stopping too). Then a step
   checkpoint when one is due (``target.every_n_steps`` / ``every_n_minutes``:
   :mod:`echelon3.trainers.step_checkpoints`), and the run ends once ``max_steps`` is
   reached.
7. One process: a preemption signal stops the run after this micro-batch, even
   inside a window. The checkpoint is written by :meth:`Trainer._preempt`, after
   the non-finite guard has checked what it would save.
8. The profiler counts the micro-batch; ``profile.stop_after`` ends the run at
   the end of a window.

After the epoch a per-epoch scheduler steps, validation runs (on the EMA
weights when on; in the step mode only if the run ends here), early stopping looks at
it, and the epoch's checkpoint is written. A run that ends in the middle of an epoch
(``max_steps``, or early stopping in the step mode) validates if its last step has not,
and ends with a step checkpoint. The hot loop never waits for the device (reads happen one log point
later) and runs no collective outside log points, except DDP's gradient
all-reduce and, under ``nan_policy: skip``, one flag per optimizer step.
Mid-epoch state has one home, :mod:`echelon3.trainers.state`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import torch
from tqdm import tqdm  # not tqdm.auto: its asyncio variant opens every loader twice

from echelon3.config.errors import blame
from echelon3.data.batches import OutputLoss, call_net, split_batch, to_device, weighted_loss
from echelon3.data.loaders import known_length
from echelon3.data.rng import restore_for_rank
from echelon3.data.samples import LABEL_ERRORS, bad_label
from echelon3.distributed.ranks import get_rank, get_world_size, unwrap
from echelon3.distributed.runtime import raise_if_interrupted
from echelon3.observe.bottleneck import EpochClock, is_compiled
from echelon3.observe.profiler import Profiler
from echelon3.optimizers.closure import is_closure_optimizer
from echelon3.trainers.checkpointing import Checkpointing
from echelon3.trainers.clipping import GradientClipping
from echelon3.trainers.collection import Collection
from echelon3.trainers.early_stopping import EarlyStopping
from echelon3.trainers.ema import EMA
from echelon3.trainers.length import RunLength
from echelon3.trainers.logpoint import LogPoint, LogPoints
from echelon3.trainers.nonfinite import NonFiniteGuard
from echelon3.trainers.preempting import Preempting
from echelon3.trainers.running import RunningLosses
from echelon3.trainers.state import EpochPosition, MidEpoch
from echelon3.trainers.step_checkpoints import StepCheckpoints, StepSaving
from echelon3.trainers.stepping import SKIP, STEP, WAIT, Stepping
from echelon3.trainers.throughput import Throughput
from echelon3.trainers.validating import Validation
from echelon3.trainers.window_end import WindowEnd

log = logging.getLogger(__name__)


class Trainer(Checkpointing, Preempting, StepCheckpoints, LogPoints, Validation,
              WindowEnd):
    """Injected: everything but the keyword settings below, which come from ``trainer.config``."""

    def __init__(self, *, net, losses, optimizer, train_loader, test_loaders, metrics,
                 checkpoints, logger, precision, device, scheduler=None, named_sets=False,
                 resume_state=None, extra_state=None, epochs: int | None = 10,
                 max_steps: int | None = None, times_to_validate_per_epoch: int = 1,
                 val_check_interval: int | None = None, validate_at_start: bool = False,
                 keep_best_on: Any = None, high_is_better: bool = True,
                 metrics_on: str | Sequence[str] | None = None, float_labels: bool = False,
                 log_every_n_steps: int = 50, progress_bar: bool = True,
                 nan_policy: str = "stop", grad_accum_steps: int = 1,
                 profile: Mapping | None = None, scheduler_interval: str = "epoch",
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                 early_stopping: Mapping | None = None, ema: Mapping | None = None,
                 count_tokens: Any = "auto", flops_per_step: Any = None,
                 peak_flops: float | None = None, gc_every_n_steps: int | None = 50):
        self.length = RunLength(epochs, max_steps, val_check_interval, validate_at_start,
                                times_to_validate_per_epoch)
        self.net, self.losses, self.optimizer = net, losses, optimizer
        self.scheduler, self.precision, self.device = scheduler, precision, device
        self._backward = precision.backward_call()
        self.train_loader, self.test_loaders, self.metrics = train_loader, test_loaders, metrics
        self.checkpoints, self.logger, self.named_sets = checkpoints, logger, named_sets
        self.epochs = self.length.epochs  # None: the run is counted in steps only
        self.float_labels, self.log_every = float_labels, max(1, int(log_every_n_steps))
        self.extra_state = dict(extra_state or {})
        self.closure = is_closure_optimizer(optimizer)
        self.from_output = isinstance(losses, OutputLoss)  # the network computes the loss
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
        self.early = EarlyStopping(early_stopping, first.name, first.high,
                                   unit="step" if self.length.by_steps else "epoch") \
            if early_stopping else None
        self.step_saving = StepSaving.of(checkpoints)
        self._lr = optimizer.param_groups[0]["lr"]  # of the last optimizer step
        self.epoch, self.global_step = 0, 0
        self.move = torch.device(device).type != "cpu"  # batches already sit on the CPU
        single = len(losses) == 1 and next(iter(losses.values()))[1] == 1
        self.running = RunningLosses(["loss", *losses], same_as_total=single, device=device)
        self.logpoint = LogPoint()
        self.throughput = Throughput(count_tokens, flops_per_step, peak_flops)
        self.throughput.resolve_peak(device, getattr(precision, "mode", "fp32"),
                                     get_world_size(), net)
        self.collection = Collection(gc_every_n_steps)
        self._syncs = Stepping.syncs(net)  # looked at again as each epoch starts
        self._clock: EpochClock | None = None
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
        loss is its own (:class:`echelon3.data.batches.OutputLoss`). With no profiler
        running and no autocast, no context is entered (nothing that is off costs)."""
        inputs, target = split_batch(batch)
        if self.move:
            inputs, target = to_device((inputs, target), self.device)
        if self.profiler.active or self.precision.dtype is not None:
            with self.profiler.label("compute"):
                with self.precision.autocast():
                    total, parts = self._forward(inputs, target)
                # No extra multiply (a kernel and an autograd node) when not accumulating.
                self._backward(total * scale if scale != 1 else total)
        else:
            total, parts = self._forward(inputs, target)
            self._backward(total * scale if scale != 1 else total)
        detached = total.detach()  # one loss of weight 1 is its own total: detached once
        out = {"loss": detached}
        for name, part in parts.items():
            out[name] = detached if part is total else part.detach()
        return out

    def _forward(self, inputs, target) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        try:  # a loss's error is marked with its own key first
            out = call_net(self.net, unwrap(self.net), self.losses, inputs, target) \
                if self.from_output else self.net(inputs)
            return weighted_loss(self.losses, out, target, self.float_labels)
        except Exception as e:
            blame(e, "net", "training")
            raise

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
            if self._syncs:  # DDP, FSDP: no all-reduce inside a window
                with self.stepping.sync(self.net, last):
                    parts = self.forward_backward(batch, scale)
            else:
                parts = self.forward_backward(batch, scale)
            decision = self.stepping.decide(parts, last)
            if decision == STEP:
                if self.profiler.active:
                    with self.profiler.label("optimizer"):
                        self._optimizer_step()
                else:
                    self._optimizer_step()
        if decision != WAIT:  # step 4's end, here rather than a call of its own per step
            losses = self.stepping.close(self.optimizer, decision)
            self.global_step += 1
            if decision == STEP and self.ema is not None:
                self.ema.update(self.global_step)
            self._lr = self.optimizer.param_groups[0]["lr"]
            if self.interval == "step" and self.scheduler is not None:
                self.scheduler.step()
            if self.collection.scheduled:
                self.collection.after_step(self.global_step)
            self.nonfinite.observe(self.epoch + 1, self.global_step, losses)
            for parts in losses:
                self.running.add(parts)
        return decision

    def _optimizer_step(self) -> None:
        if self.clipping.on:
            self.clipping.clip(self.optimizer, self._params())
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ the loop

    def _train_epoch(self, epoch: int, clock: EpochClock) -> str | None:
        """One epoch; why the run ends inside it (``profiled``: ``profile.stop_after``,
        ``length``: ``max_steps``, ``early``: early stopping in the step mode), else None."""
        batches, done = self.position.start(self.train_loader, epoch, get_rank())
        self.net.train()
        self._syncs = Stepping.syncs(self.net)
        steps = known_length(self.train_loader)  # None: a stream of unknown length
        windows = None if steps is None else self.stepping.windows_in(steps)
        validate_at = self.length.mid_epoch_points(windows)
        # On a GPU one step per log interval runs between CUDA events.
        sample_at = self.log_every // 2 if clock.cuda and self.log_every >= 4 else -1
        self._bar = bar = self._progress(epoch, steps, done)
        self._stop, ended, profiled = False, None, False
        whole = self.stepping.steps == 1  # every micro-batch closes its window
        bar_on, profiling = not bar.disable, self.profiler.enabled
        next_event = self._next_event(done, validate_at)
        self.throughput.start(time.perf_counter(), self.global_step, clock.aside_total)
        for i, batch in enumerate(self.profiler.batches(clock.batches(batches)), start=done + 1):
            raise_if_interrupted()
            scale, last = (1.0, True) if whole else self.stepping.window(i - 1, steps)
            if self.throughput.counting:  # once: the FLOPs of a step, for the MFU
                from echelon3.trainers.flops import micro_batch_flops  # its import: only now

                with clock.aside():  # training untouched
                    self.throughput.counted(micro_batch_flops(
                        self.net, self.losses, batch, self.precision, self._params(),
                        self.device, self.float_labels), self.stepping.steps)
            started = time.perf_counter()
            try:  # a label outside a metric's classes is named (naming_bad_labels, inlined)
                if i % self.log_every == sample_at:
                    decision = clock.sample_device(lambda: self.micro_batch(batch, scale, last))
                else:
                    decision = self.micro_batch(batch, scale, last)
            except LABEL_ERRORS as e:
                named = bad_label(batch, self.metrics)
                if named is None:
                    raise
                raise named from e
            clock.step_ended(started)
            self.throughput.add(batch)
            self.position.step = i
            if bar_on:
                bar.update()
            if profiling:
                profiled = self.profiler.step() or profiled
            if decision == WAIT:
                if self._stop_requested():
                    self._preempt(epoch)
                continue
            if self.global_step >= next_event or self._attention():
                ended = self._after_window(epoch, i, steps, validate_at, clock)
                next_event = self._next_event(i, validate_at)
            ended = ended or ("profiled" if profiled else None)
            if ended:
                break
        if ended is None and self.stepping.losses:  # a stream's last window, not full
            self.stepping.close(self.optimizer, SKIP)
            log.info("the stream ended inside an accumulation window; its %d micro-batch(es) "
                     "were dropped", i % self.stepping.steps)
        self._log_point(epoch + 1)
        self._flush_logs()
        bar.close()
        self._bar = None
        if self._stop:
            self._preempt(epoch)
        return ended

    def _progress(self, epoch: int, steps: int | None, done: int):
        total, initial, desc = self.length.bar(epoch, steps, done, self.global_step,
                                               self.stepping.steps)
        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                    disable=None if self.progress_bar else True)

    def fit(self) -> dict[str, float] | None:
        # Python's garbage: at the same steps on all ranks (one process: its own collector)
        with self.collection.during_fit(get_world_size()):
            return self._fit()

    def _fit(self) -> dict[str, float] | None:
        if self._resume_rng is not None:
            restore_for_rank(*self._resume_rng, get_rank(), get_world_size())
            self._resume_rng = None
        self.logger.rewind(self.global_step)
        done = self.stopped_early() or self.length.finished(self.epoch, self.global_step)
        if done:
            log.info("nothing to train: %s", done)
        self._clock = clock = EpochClock(self.device, self.train_loader,
                                         compiled=is_compiled(self.net))
        start = self.epoch
        report_after = start + 1 if self.epochs is None else min(start + 1, self.epochs - 1)
        self.profiler.start()
        if not done and self.length.at_start and self.global_step == 0:
            self.validate(1)  # before the first step (validate_at_start)
        epoch = self.epoch
        while not done and epoch < self.length.epoch_count:
            ended = self._train_epoch(epoch, clock)
            if ended in ("length", "early") and self.position.step < (
                    known_length(self.train_loader) or float("inf")):
                self._end_mid_epoch(epoch, ended)
                break
            if ended == "profiled":
                break
            stop = self._end_epoch(epoch, clock, last=ended == "length")
            clock.log_epoch(self.logger, self.epoch, self.global_step,
                            first=epoch == report_after, warm=epoch > start)
            if stop:
                log.info("%s (trainer.config.early_stopping)", self.stopped_early())
                break
            if ended:
                break
            epoch += 1
        self.profiler.stop()
        self.checkpoints.ensure_best()
        self.nonfinite.end_fit()
        return self.best_metrics

    def _end_epoch(self, epoch: int, clock: EpochClock, last: bool) -> bool:
        """After epoch ``epoch`` (0-based): scheduler, validation, early stopping, the
        epoch's checkpoint; True when early stopping ends the run."""
        if self.scheduler is not None and self.interval == "epoch":
            self.scheduler.step()
        self.epoch = epoch + 1
        self.nonfinite.end_epoch(self.epoch)
        with clock.aside():
            best, stop = False, False
            if not self.length.by_steps or last or self.length.validates_after(
                    self.global_step) or self.epochs is not None and self.epoch >= self.epochs:
                best = self.validate(self.epoch, save_best=False)
                unit_done = self.global_step if self.length.by_steps else self.epoch
                stop = self.early is not None and self.early.update(unit_done,
                                                                    self.last_metrics)
            self.checkpoints.save_checkpoint(self.state_dict(), self.epoch, best=best)
        return stop

    def _end_mid_epoch(self, epoch: int, why: str) -> None:
        """The run ends inside epoch ``epoch`` (0-based): validate if the last step has not,
        then a step checkpoint, from which a longer run would go on exactly."""
        if why == "length":
            self.validate(epoch + 1)
        else:
            log.info("%s (trainer.config.early_stopping)", self.stopped_early())
        self._save_step(epoch)

"""Steps 5-7 of the trainer's order (:mod:`echelon3.trainers.baseline`), after a window closed:
the log point, validation, a step checkpoint, ``max_steps``, a preemption.

Most optimizer steps have none of these. Every one counted in steps (a log point every
``log_every_n_steps``, a validation at a window of the epoch or every
``val_check_interval``, a step checkpoint every ``target.every_n_steps``, ``max_steps``)
falls on a step known in advance, so the loop compares ``global_step`` with the nearest of
them (:meth:`WindowEnd._next_event`) and otherwise looks only at the flags that arrive on
their own: a timed step checkpoint due, a preemption. Mixed into the trainer.
"""

from __future__ import annotations

from echelon3.distributed import preemption
from echelon3.distributed.ranks import get_world_size


def _next_multiple(step: int, every: int | None) -> float:
    return float("inf") if not every else step - step % every + every


class WindowEnd:
    def _attention(self) -> bool:
        """A step checkpoint due by the clock, or a preemption: look after this window."""
        return self.step_saving.due or self._stop or preemption.requested() is not None

    def _next_event(self, i: int, validate_at: set) -> float:
        """The next ``global_step`` at which :meth:`_after_window` acts by count, after
        micro-batch ``i`` (1-based in the epoch) closed its window."""
        step, length = self.global_step, self.length
        window = self.stepping.windows_in(i)  # closed so far in the epoch
        later = [w - window for w in validate_at if w > window]
        return min(_next_multiple(step, self.log_every),
                   _next_multiple(step, length.interval),
                   _next_multiple(step, self.step_saving.every_n_steps),
                   float("inf") if length.max_steps is None else max(length.max_steps, step + 1),
                   step + min(later, default=float("inf")))

    def _after_window(self, epoch: int, i: int, steps: int | None, validate_at: set,
                      clock) -> str | None:
        """Steps 5-7 after an optimizer step (or skip); why the run ends here, if it does."""
        epoch_ends = steps is not None and i >= steps
        if self.global_step % self.log_every == 0 and not epoch_ends:
            self._log_point(epoch + 1)
        ends = self.length.reached(self.global_step)
        if self.stepping.windows_in(i) in validate_at or \
                (self.length.validates_after(self.global_step) and not (ends or epoch_ends)):
            with clock.aside():
                self.validate(epoch + 1)
                if self.length.by_steps and self.early is not None and \
                        self.early.update(self.global_step, self.last_metrics):
                    return "early"
        if ends:
            return "length"
        if self.step_saving.after_step(self.global_step) and not epoch_ends:
            with clock.aside():
                self._save_step(epoch)
        if self._stop_requested():
            self._preempt(epoch)
        return None

    def _stop_requested(self) -> bool:
        """Step 7: one process stops on its own signal; ranks on the log point's flag."""
        return self._stop or (preemption.requested() is not None and get_world_size() == 1)

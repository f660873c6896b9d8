"""The loop looks after a window (steps 5-7) exactly at the steps where something counted in
steps acts: ``WindowEnd._next_event`` against the conditions of ``_after_window`` itself,
window by window, for every mix of log points, validation points, step checkpoints,
``max_steps`` and accumulation."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from echelon3.trainers.length import RunLength
from echelon3.trainers.step_checkpoints import StepSaving
from echelon3.trainers.window_end import WindowEnd


def _acts(t, i: int, validate_at: set) -> bool:
    """What ``_after_window`` does by count after micro-batch ``i`` closed its window."""
    step = t.global_step
    return (step % t.log_every == 0 or t.length.reached(step) or
            -(-i // t.stepping.steps) in validate_at or t.length.validates_after(step) or
            t.step_saving.after_step(step))


@settings(max_examples=300, deadline=None)
@given(log_every=st.integers(1, 9), accum=st.integers(1, 4), batches=st.integers(1, 40),
       epochs=st.integers(1, 3), max_steps=st.none() | st.integers(1, 60),
       interval=st.none() | st.integers(1, 9), per_epoch=st.integers(1, 5),
       every_n_steps=st.none() | st.integers(1, 9), start=st.integers(0, 20))
def test_the_next_event_is_the_next_step_that_acts(log_every, accum, batches, epochs,
                                                   max_steps, interval, per_epoch,
                                                   every_n_steps, start):
    length = RunLength(epochs, max_steps, interval, False, 1 if interval else per_epoch)
    t = SimpleNamespace(global_step=start, log_every=log_every, length=length,
                        stepping=SimpleNamespace(steps=accum, windows_in=lambda n: -(-n // accum)),
                        step_saving=StepSaving(every_n_steps))
    t._next_event = WindowEnd._next_event.__get__(t)
    for _ in range(epochs):
        windows = -(-batches // accum)
        validate_at = length.mid_epoch_points(windows)
        upcoming = t._next_event(0, validate_at)
        for i in range(1, batches + 1):
            if i % accum and i != batches:
                continue  # the window is still open
            t.global_step += 1
            assert (t.global_step >= upcoming) == _acts(t, i, validate_at), \
                (t.global_step, i, upcoming)
            if t.global_step >= upcoming:
                upcoming = t._next_event(i, validate_at)

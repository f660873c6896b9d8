"""The workflow's pictures: learning curves per experiment, test metrics over all
experiments, and one chart per sweep. Used by report.py.

The curves name the data they were validated on: "validation", or "test" for a run
without validation data (the test set then chose best.tar). A fine-tuned run's
curves continue its parent's, from the epoch of the parent's best.tar it started from."""

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

RECORD_KEYS = ("split", "epoch", "step", "lr")
STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--")]


def direction(higher_is_better):
    return "higher is better" if higher_is_better else "lower is better"


def _is_loss(key):
    return key == "loss" or key.endswith("/loss")


def _epoch_ends(records):
    """The last step of each epoch, from its records."""
    ends = {}
    for r in records:
        if "epoch" in r and "step" in r:
            ends[r["epoch"]] = max(ends.get(r["epoch"], 0), r["step"])
    return ends


def _at(epoch, step, ends):
    """Where a record of ``epoch`` (1-based, as records count) at ``step`` sits on the epoch
    axis: the last step of epoch e at e, a validation in the middle of epoch 2 between 1
    and 2; its epoch when the step is not known."""
    if step is None or epoch not in ends:
        return epoch
    start = ends.get(epoch - 1, 0)
    return epoch - 1 + (step - start) / max(ends[epoch] - start, 1)


def _at_step(epoch, step, ends):
    """A run counted in steps (``max_steps``): its records sit at their optimizer step."""
    return step if step is not None else 0


def _train_points(train, ends, at=_at):
    """(fractional epoch, or step, loss) of each train record."""
    return [(at(r["epoch"], r["step"], ends), r["loss"]) for r in train]


def _mark_best(ax, best_epoch, at, offset=0, best_step=None, by_steps=False):
    if best_epoch is None:
        return
    what = f"step {best_step}" if by_steps else f"epoch {best_epoch}"
    ax.axvline(at + offset, color="tab:red", ls="--", lw=1, alpha=0.8,
               label=f"best.tar: {what}")


def _keep_span(ax, values):
    """At least 1% of the values' size on the y axis: two points 0.0001 apart draw as
    the flat line they are, not as a cliff."""
    if not values:
        return
    low, high = min(values), max(values)
    least = max(0.01 * max(abs(low), abs(high)), 1e-3)
    if high - low < least:
        middle = (low + high) / 2
        ax.set_ylim(middle - least, middle + least)


def _finish_axes(ax, title, ylabel, xlabel="epoch"):
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not ax.has_data():
        ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _split(records):
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    val = [r for r in records if r.get("split") == "val"]
    keys = list(dict.fromkeys(k for r in val for k in r if k not in RECORD_KEYS))
    return train, val, keys


def _draw_parent(loss_ax, metric_ax, parent, at=_at):
    """The parent's curves up to the epoch of its best.tar, which the child starts from;
    that epoch (the child's x offset), or 0 without a parent."""
    if parent is None:
        return 0
    name, records, best = parent
    if best.get("epoch") is None:
        return 0
    ends = _epoch_ends(records)
    start = at(best["epoch"], best.get("step"), ends)
    kept = [r for r in records if r.get("epoch", 0) <= best["epoch"]
            and (best.get("step") is None or r.get("step", 0) <= best["step"])]
    train, val, keys = _split(kept)
    if train:
        loss_ax.plot(*zip(*_train_points(train, ends, at)), lw=1, color="0.6",
                     label=f"{name}: train")
    for key in keys:
        points = [(at(r["epoch"], r.get("step"), ends), r[key]) for r in val
                  if isinstance(r.get(key), (int, float))]
        if points:
            ax = loss_ax if _is_loss(key) else metric_ax
            ax.plot(*zip(*points), marker=".", ls=":", color="0.5", alpha=0.8,
                    label=f"{name}: validation {key}" if _is_loss(key) else f"{name}: {key}")
    for ax in (loss_ax, metric_ax):
        ax.axvline(start, color="0.3", lw=1, label=f"fine-tuning starts ({name} best.tar)")
    return start


def _draw_speed(ax, train, ends, at, offset):
    """The train records' throughput (tokens/s when counted, else samples/s) and, on a
    second axis, their MFU."""
    rate = "tokens_per_s" if any("tokens_per_s" in r for r in train) else "samples_per_s"
    points = [(at(r["epoch"], r["step"], ends) + offset, r[rate]) for r in train if rate in r]
    if points:
        ax.plot(*zip(*points), lw=1, color="tab:green", label=rate.replace("_per_s", "/s"))
    mfu = [(at(r["epoch"], r["step"], ends) + offset, 100 * r["mfu"]) for r in train
           if isinstance(r.get("mfu"), (int, float))]
    if mfu:
        twin = ax.twinx()
        twin.plot(*zip(*mfu), lw=1, ls="--", color="tab:purple", label="MFU")
        twin.set_ylabel("MFU (%)")
        twin.legend(fontsize="small", loc="lower right")
    return rate.replace("_per_s", "/s")


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_curves(name, records, best_epoch, selected_on="val", parent=None, best_step=None,
                by_steps=False):
    """Losses (train, running mean per logged step; validation at its step) on the left,
    validation metrics on the right, each on its own labelled axis; best.tar (summary's
    best epoch and step) marked on both. `selected_on: test`: the curves say test, not
    validation. `parent`: (name, records, summary's best) of the run this one was
    fine-tuned from. `by_steps`: a run counted in steps (``max_steps``), drawn against
    optimizer steps instead of epochs. Train records with a throughput add a third
    panel: tokens/s (or samples/s) and the MFU."""
    train, val, keys = _split(records)
    ends = _epoch_ends(records)
    at = _at_step if by_steps else _at
    unit = "step" if by_steps else "epoch"
    data = "validation" if selected_on == "val" else "test"
    speed = any("samples_per_s" in r for r in train)
    fig, axes = plt.subplots(1, 3 if speed else 2, figsize=(16 if speed else 11, 4))
    loss_ax, metric_ax = axes[:2]
    offset = _draw_parent(loss_ax, metric_ax, parent, at)
    if train:
        xs, ys = zip(*_train_points(train, ends, at))
        loss_ax.plot([x + offset for x in xs], ys, lw=1, alpha=0.7, label="train")
    shown = {loss_ax: [], metric_ax: []}
    for i, key in enumerate(keys):
        points = [(at(r["epoch"], r.get("step"), ends) + offset, r[key]) for r in val
                  if isinstance(r.get(key), (int, float))]
        if not points:
            continue
        marker, line = STYLES[i % len(STYLES)]
        ax = loss_ax if _is_loss(key) else metric_ax
        label = f"{data} {key}" if _is_loss(key) else key
        ax.plot(*zip(*points), marker=marker, ls=line, ms=4, alpha=0.85, label=label)
        shown[ax] += [v for _, v in points]
        if len(points) <= 2 and ax is metric_ax and not offset:
            # a few points: their values, not a shape (above one curve, below the next)
            above = len(shown[ax]) // len(points) % 2 == 1
            for x, v in points:
                ax.annotate(f"{v:.4f}", (x, v), xytext=(0, 6 if above else -12),
                            textcoords="offset points", ha="center", fontsize="x-small")
    for ax in (loss_ax, metric_ax):
        _mark_best(ax, best_epoch, at(best_epoch, best_step, ends), offset, best_step,
                   by_steps)
        if offset == 0:
            _keep_span(ax, shown[ax])
    xlabel = f"{unit} ({parent[0]}, then {name})" if offset else unit
    _finish_axes(loss_ax, "loss (lower is better)", "loss", xlabel)
    chosen = "validation metrics" if data == "validation" else \
        "test-set metrics (no validation data: the test set chose best.tar)"
    _finish_axes(metric_ax, chosen, "metric value", xlabel)
    if speed:
        rate = _draw_speed(axes[2], train, ends, at, offset)
        _finish_axes(axes[2], "training throughput (higher is better)", rate, xlabel)
    fig.suptitle(f"{name}: learning curves" + (f", fine-tuned from {parent[0]}" if offset
                                                else ""))
    return fig


def _span(values):
    """x limits around the data (never from 0 unless the data is there)."""
    low, high = min(values), max(values)
    pad = (high - low) * 0.15 or max(abs(high) * 0.01, 1e-3)
    return low - pad, high + pad


def draw_metrics(table, metric_columns, metric, higher_is_better):
    """One dot panel per metric, experiments in leaderboard order (best on top), the
    axis spanning the values; the ranking metric's panel says so and which way is better,
    a loss panel that lower is better; an experiment selected on the test set says so."""
    n = max(len(metric_columns), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 0.45 * len(table) + 1.8), squeeze=False)
    on_test = list(table["selected_on"] == "test") if "selected_on" in table else \
        [False] * len(table)
    names = [f"{name}\n(selected on test)" if test else name
             for name, test in zip(table["experiment"], on_test)][::-1]
    for ax, column in zip(axes[0], metric_columns):
        values = list(table[column])[::-1]
        known = [(y, v) for y, v in enumerate(values) if not math.isnan(v)]
        if not known:
            continue
        ax.hlines([y for y, _ in known], *_span([v for _, v in known]), color="0.85", lw=1)
        ax.plot([v for _, v in known], [y for y, _ in known], "o",
                color="tab:red" if column == metric else "tab:blue")
        for y, v in known:
            ax.annotate(f"{v:.4f}", (v, y), xytext=(0, 6), textcoords="offset points",
                        ha="center", fontsize="small")
        ax.set_xlim(*_span([v for _, v in known]))
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(-0.6, len(names) - 0.4)
        if column == metric:
            ranking = f"\n(ranks the leaderboard, {direction(higher_is_better)})"
        else:
            ranking = f"\n({direction(False)})" if _is_loss(column.split(" ", 1)[-1]) else ""
        ax.set_title(f"{column}{ranking}", fontsize="medium")
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[0][1:]:
        ax.tick_params(labelleft=False)
    fig.suptitle("test metrics by experiment (metrics.json)")
    return fig


def _numeric(values):
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def draw_sweep(name, sweep, table, metric, higher_is_better):
    """The ranking metric against the sweep's first grid key; one line per
    combination of the other keys; the best point starred."""
    keys = sweep["keys"]
    x_key, others = keys[0], keys[1:]
    scores = dict(zip(table["experiment"], table[metric]))
    lines = {}
    for exp, point in sweep["points"].items():
        label = ", ".join(f"{k}={point[k]}" for k in others) or metric
        lines.setdefault(label, []).append((point[x_key], scores.get(exp, math.nan)))
    xs = [x for points in lines.values() for x, _ in points]
    numeric = _numeric(xs)
    order = sorted(set(xs)) if numeric else list(dict.fromkeys(xs))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (label, points) in enumerate(lines.items()):
        points.sort(key=lambda p: order.index(p[0]))
        marker, line = STYLES[i % len(STYLES)]
        at = [p[0] if numeric else order.index(p[0]) for p in points]
        ax.plot(at, [p[1] for p in points], marker=marker, ls=line, label=label)
    scored = [(point, scores[exp]) for exp, point in sweep["points"].items()
              if not math.isnan(scores.get(exp, math.nan))]
    if scored:
        point, score = (max if higher_is_better else min)(scored, key=lambda p: p[1])
        x = point[x_key]
        ax.plot(x if numeric else order.index(x), score, "*", ms=16, color="tab:red",
                label="best: " + ", ".join(f"{k}={point[k]}" for k in keys))
    if numeric and min(order) > 0 and max(order) / min(order) >= 100:
        ax.set_xscale("log")
    if numeric:
        ax.set_xticks(order, [f"{v:g}" for v in order])
    else:
        ax.set_xticks(range(len(order)), [str(v) for v in order])
    ax.minorticks_off()
    ax.set(xlabel=x_key, ylabel=f"{metric} ({direction(higher_is_better)})",
           title=f"sweep {name}: {metric} by {x_key}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig

"""The workflow's pictures: learning curves per experiment, test metrics over all
experiments, and one chart per sweep. Used by report.py."""

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


def _train_points(train):
    """(fractional epoch, loss) of each train record: the last step of epoch e sits at e."""
    ends = {}
    for r in train:
        ends[r["epoch"]] = max(ends.get(r["epoch"], 0), r["step"])
    points = []
    for r in train:
        start = ends.get(r["epoch"] - 1, 0)
        span = max(ends[r["epoch"]] - start, 1)
        points.append((r["epoch"] - 1 + (r["step"] - start) / span, r["loss"]))
    return points


def _mark_best(ax, best_epoch):
    if best_epoch is None:
        return
    ax.axvline(best_epoch, color="tab:red", ls="--", lw=1, alpha=0.8,
               label=f"best.tar: epoch {best_epoch}")


def _finish_axes(ax, title, ylabel):
    ax.set(title=title, xlabel="epoch", ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if not ax.has_data():
        ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_curves(name, records, best_epoch):
    """Losses (train, running mean per logged step; validation per epoch) on the left,
    validation metrics on the right, each on its own labelled axis; the epoch of
    best.tar marked on both."""
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    val = [r for r in records if r.get("split") == "val"]
    keys = list(dict.fromkeys(k for r in val for k in r if k not in RECORD_KEYS))
    fig, (loss_ax, metric_ax) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        loss_ax.plot(*zip(*_train_points(train)), lw=1, alpha=0.7, label="train")
    for i, key in enumerate(keys):
        points = [(r["epoch"], r[key]) for r in val if isinstance(r.get(key), (int, float))]
        if not points:
            continue
        marker, line = STYLES[i % len(STYLES)]
        ax = loss_ax if _is_loss(key) else metric_ax
        label = f"validation {key}" if _is_loss(key) else key
        ax.plot(*zip(*points), marker=marker, ls=line, ms=4, alpha=0.85, label=label)
    for ax in (loss_ax, metric_ax):
        _mark_best(ax, best_epoch)
    _finish_axes(loss_ax, "loss", "loss")
    _finish_axes(metric_ax, "validation metrics", "metric value")
    fig.suptitle(f"{name}: learning curves")
    return fig


def _span(values):
    """x limits around the data (never from 0 unless the data is there)."""
    low, high = min(values), max(values)
    pad = (high - low) * 0.15 or max(abs(high) * 0.01, 1e-3)
    return low - pad, high + pad


def draw_metrics(table, metric_columns, metric, higher_is_better):
    """One dot panel per metric, experiments in leaderboard order (best on top), the
    axis spanning the values; the ranking metric's panel says so and which way is better."""
    n = max(len(metric_columns), 1)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 0.45 * len(table) + 1.8), squeeze=False)
    names = list(table["experiment"])[::-1]
    for ax, column in zip(axes[0], metric_columns):
        values = list(table[column])[::-1]
        known = [(y, v) for y, v in enumerate(values) if not math.isnan(v)]
        if not known:
            continue
        ax.hlines([y for y, _ in known], *_span([v for _, v in known]), color="0.85", lw=1)
        ax.plot([v for _, v in known], [y for y, _ in known], "o",
                color="tab:red" if column == metric else "tab:blue")
        for y, v in known:
            ax.annotate(f"{v:.4g}", (v, y), xytext=(0, 6), textcoords="offset points",
                        ha="center", fontsize="small")
        ax.set_xlim(*_span([v for _, v in known]))
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(-0.6, len(names) - 0.4)
        ranking = f"\n(ranks the leaderboard, {direction(higher_is_better)})" if column == metric \
            else ""
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

"""The report's plots, each a PNG as base64 text (for a data URI).

Only matplotlib (Agg, through ``matplotlib.figure.Figure``; no pyplot global
state) is needed; it is imported when a plot is drawn.  Every plot takes the
runs, their per-step series (:mod:`lorasync.monitor.runstats`), their
strategy switches and one colour per run.
"""

from __future__ import annotations

import base64
import io
import math
import statistics

from lorasync.errors import LorasyncError

__all__ = ["run_colors", "plot_throughput", "plot_time_split", "plot_wire", "plot_loss"]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#7f7f7f", "#bcbd22")


def run_colors(n: int) -> list[str]:
    """One colour per run, in the order given."""
    return [_COLORS[i % len(_COLORS)] for i in range(n)]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _new_figure(nrows: int = 1, height: float = 3.6, sharey: bool = False):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise LorasyncError("the report needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(10, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, 1, squeeze=False, sharex=True, sharey=sharey)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _mark_switches(ax, switches: list[dict], color: str, label_prefix: str = "") -> None:
    """A vertical line at the boundary before the step that ran the new strategy,
    labelled "from → to" along the line."""
    for sw in switches:
        x = sw["step"] - 0.5
        ax.axvline(x, color=color, linestyle="--", linewidth=1.2, alpha=0.8)
        text = f"{label_prefix}{sw['from']} → {sw['to']}"
        ax.text(x, 0.97, " " + text, transform=ax.get_xaxis_transform(), rotation=90,
                va="top", ha="right", fontsize=8, color=color,
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})


def _width(i: int, n: int, base: float = 1.5) -> float:
    """Overlaid runs often coincide (same seed, same bytes): earlier runs drawn
    wider stay visible under later ones."""
    return base + 1.5 * (n - 1 - i)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in values:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def plot_throughput(runs, series, switches, colors) -> str:
    fig, (ax,) = _new_figure()
    for i, (run, rows, sw, c) in enumerate(zip(runs, series, switches, colors)):
        x = [r["step"] for r in rows]
        y = [r["samples_per_s"] for r in rows]
        window = max(1, len(rows) // 20)
        if window > 1:
            ax.plot(x, y, color=c, alpha=0.3, linewidth=0.8)
            ax.plot(x, _smooth(y, window), color=c, linewidth=_width(i, len(runs), 2.0),
                    label=f"{run.name} (mean of {window} steps)")
        else:
            ax.plot(x, y, color=c, linewidth=_width(i, len(runs), 1.8), marker="o",
                    markersize=3, label=run.name)
        _mark_switches(ax, sw, c)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title("Throughput: samples of all ranks / slowest rank's step time")
    ax.legend(loc="lower right", fontsize=9)
    return _png(fig)


def plot_time_split(runs, series, switches, colors) -> str:
    fig, axes = _new_figure(len(runs), height=3.0 if len(runs) > 1 else 3.6, sharey=True)
    for ax, run, rows, sw, c in zip(axes, runs, series, switches, colors):
        x = [r["step"] for r in rows]
        comp = [r["compute_s"] for r in rows]
        comm = [r["comm_s"] for r in rows]
        other = [r["other_s"] for r in rows]
        if len(rows) <= 200:
            ax.bar(x, comp, width=0.85, color="#4c72b0", label="compute")
            ax.bar(x, comm, width=0.85, bottom=comp, color="#dd8452", label="exposed sync")
            ax.bar(x, other, width=0.85, bottom=[a + b for a, b in zip(comp, comm)],
                   color="#bbbbbb", label="data / other")
        else:  # thousands of bars render as noise; areas read better
            ax.stackplot(x, comp, comm, other, colors=("#4c72b0", "#dd8452", "#bbbbbb"),
                         labels=("compute", "exposed sync", "data / other"), linewidth=0)
        _mark_switches(ax, sw, "black")
        ax.set_ylabel("seconds per step")
        what = "(mean over ranks)"
        if run.kind == "trainer":
            what = ("(rank 0, mean over each logging window)"
                    if any(math.isfinite(v) for v in comm)
                    else "no lorasync/* timings in the Trainer's logs")
        ax.set_title(f"{run.name}: compute vs exposed sync per step {what}",
                     fontsize=10, color=c if len(runs) > 1 else "black")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("step")
    return _png(fig)


def plot_wire(runs, series, switches, colors) -> str:
    fig, (ax,) = _new_figure()
    top = 0.0
    for i, (run, rows, sw, c) in enumerate(zip(runs, series, switches, colors)):
        x = [r["step"] for r in rows]
        y = [r["wire_bytes"] / 1e6 for r in rows]
        top = max([top, *y])
        ax.step(x, y, where="mid", color=c, linewidth=_width(i, len(runs)), label=run.name)
        _mark_switches(ax, sw, c)
    fp32 = [r["fp32_bytes"] for r in series[0] if r["fp32_bytes"] is not None]
    if fp32:
        ax.axhline(statistics.median(fp32) / 1e6, color="gray", linestyle=":", linewidth=1.5,
                   label="fp32 all-reduce")
        top = max(top, statistics.median(fp32) / 1e6)
    # headroom above the highest line for the switch labels
    ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("MB per rank")
    ax.set_title("Wire bytes per step (handed to collectives, mean over ranks)")
    ax.legend(loc="best", fontsize=9)
    return _png(fig)


def plot_loss(runs, series, switches, colors) -> str:
    fig, (ax,) = _new_figure()
    any_eval = False
    for i, (run, rows, sw, c) in enumerate(zip(runs, series, switches, colors)):
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=c,
                linewidth=_width(i, len(runs)), alpha=0.9, label=f"{run.name} train")
        pts = [(e["step"], e["eval_loss"]) for e in run.evals
               if e.get("eval_loss") is not None]
        if pts:
            any_eval = True
            ax.plot(*zip(*pts), color=c, marker="D", markersize=6, linestyle=":",
                    markeredgecolor="black", label=f"{run.name} eval")
        _mark_switches(ax, sw, c)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss: train (mean over ranks)" + (", eval (diamonds)" if any_eval else ""))
    ax.legend(loc="upper right", fontsize=9)
    return _png(fig)


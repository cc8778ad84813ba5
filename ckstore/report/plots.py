"""The report's plots: matplotlib figures written as inline SVG (text as paths: no fonts to load).

Only ``matplotlib.figure.Figure`` is used, never pyplot: no global state, no GUI backend.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import matplotlib
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from ckstore.report.data import Metric, ReportData
from ckstore.report.lanes import Lane

MIB = float(1 << 20)
OPTIMIZER_ROW = "optimizer state"


def _svg(fig: Figure, salt: str) -> str:
    """The figure as an ``<svg>`` element; ``salt`` keeps its element ids apart from the other
    plots' in the same page."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt, "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _commit_ticks(ax: matplotlib.axes.Axes, count: int, labels: Sequence[str]) -> None:
    step = max(1, math.ceil(count / 25))
    ticks = list(range(0, count, step))
    ax.set_xticks([t + 0.5 for t in ticks], [labels[t] for t in ticks], rotation=90, fontsize=7, parse_math=False)


def _lane_marks(ax: matplotlib.axes.Axes, data: ReportData) -> None:
    """A line where each branch's columns start after the first, named with its fork point."""
    start = 0
    for lane in data.lanes:
        if start and lane.own:
            ax.axvline(start, color="#1f77b4", linewidth=1.2)
            fork = f" (from {lane.fork_lane} {lane.fork[:7]})" if lane.fork and lane.fork_lane else ""
            ax.annotate(
                f"{lane.name}{fork}",
                (start, 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                color="#1f77b4",
                xytext=(2, 2),
                textcoords="offset points",
                va="bottom",
            )
        start += len(lane.own)


def heatmap(data: ReportData, labels: Sequence[str]) -> str:
    """Modules x commits, colour = log10 of the relative change; frozen (0) cells in a colour of
    their own, unknown ones (first commit, new module) left blank."""
    from ckstore.report.data import group_change

    groups = data.groups
    rows = {name: groups.changing(members) for name, members in groups.modules.items()}
    if groups.optimizer:  # folded into one row, below the weights
        rows[f"{OPTIMIZER_ROW} ({len(groups.optimizer)} parameters)"] = groups.folded_optimizer()
    names = list(rows)
    n = len(data.commits)
    values = np.full((len(names), n), np.nan)
    for i, name in enumerate(names):
        for j in range(n):
            change = group_change(data.commits, j, rows[name])
            if change is not None:
                values[i, j] = change
    height = 1.5 + 0.22 * len(names)
    fig = Figure(figsize=(min(4 + 0.12 * n, 18), height))
    ax = fig.add_subplot()
    moving = np.ma.masked_where(~(values > 0), values)
    logged = np.ma.log10(moving)
    finite = logged.compressed()
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (-6.0, 0.0)
    mesh = ax.pcolormesh(logged, cmap="magma_r", vmin=low, vmax=max(high, low + 1e-9), edgecolors="none")
    frozen = np.ma.masked_where(values != 0, np.zeros_like(values))
    ax.pcolormesh(frozen, cmap=ListedColormap(["#9ecae1"]), edgecolors="none")
    ax.set_yticks(np.arange(len(names)) + 0.5, names, fontsize=7, parse_math=False)  # names are not TeX
    ax.invert_yaxis()
    _commit_ticks(ax, n, labels)
    _lane_marks(ax, data)
    ax.set_xlabel("commit (oldest left); light blue: no change; blank: no parent to compare")
    fig.colorbar(mesh, ax=ax, label="log10 relative change ||Δ|| / ||parent||", pad=0.01)
    return _svg(fig, "heatmap")


def storage(data: ReportData, labels: Sequence[str]) -> str:
    """Cumulative bytes of keeping every commit (plain safetensors, torch.save, this store), and
    per commit what it added when made, what it has new now and what it holds alone."""
    rows = data.commits
    x = np.arange(len(rows))
    fig = Figure(figsize=(min(5 + 0.12 * len(rows), 18), 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(x + 0.5, np.cumsum([r.commit.logical_bytes for r in rows]) / MIB, label="files as they are (safetensors)")
    top.plot(
        x + 0.5, np.cumsum([r.torch_save_bytes for r in rows]) / MIB, label="torch.save (estimate)", linestyle="--"
    )
    top.plot(x + 0.5, np.cumsum([r.commit.added_bytes for r in rows]) / MIB, label="ckstore: added when committed")
    top.set_ylabel("MiB, keeping every commit")
    top.legend(fontsize=8)
    width = 0.4
    bottom.bar(x + 0.3, [r.sizes.new_bytes / MIB for r in rows], width, label="new (log --sizes)")
    bottom.bar(x + 0.7, [(r.sizes.held_alone_bytes or 0) / MIB for r in rows], width, label="held alone (log --sizes)")
    bottom.set_ylabel("MiB per commit, now")
    bottom.legend(fontsize=8)
    _commit_ticks(bottom, len(rows), labels)
    _lane_marks(top, data)
    return _svg(fig, "storage")


def metric(m: Metric, lanes: Sequence[Lane]) -> str:
    """One metric's curve per branch over its whole history (x: the run counter when every point
    records it), each branch's fork point ringed, the best marked."""
    fig = Figure(figsize=(6, 3))
    ax = fig.add_subplot()
    best_x: float | None = None
    for series in m.series:
        if not series.values:
            continue
        (line,) = ax.plot(series.x, series.values, marker=".", linewidth=1, label=series.lane)
        if series.fork is not None:
            ax.plot(
                [series.x[series.fork]],
                [series.values[series.fork]],
                marker="o",
                markersize=9,
                markerfacecolor="none",
                color=line.get_color(),
                linestyle="none",
            )
        if m.best in series.ids and best_x is None:
            best_x = series.x[series.ids.index(m.best)]
    if best_x is not None:  # the best commit is in some series by construction
        ax.plot(
            [best_x],
            [m.best_value],
            marker="*",
            markersize=14,
            color="#d62728",
            linestyle="none",
            label=f"best ({'max' if m.maximize else 'min'}): {m.best_value:.4g}",
        )
    ax.set_title(m.name, fontsize=10, parse_math=False)  # a metric name is not TeX
    ax.set_xlabel(m.x_label + ("" if len(lanes) < 2 else "; ring: where a branch forks"), fontsize=8)
    ax.legend(fontsize=8)
    return _svg(fig, f"metric-{m.name}")

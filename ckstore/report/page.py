"""``ckstore report``: one self-contained HTML file (inline CSS and SVG; no script, font or request).

Every number a test or a script may check carries its exact value in a ``data-`` attribute next
to the rounded text a person reads: ``data-id`` on each commit's row and column,
``data-new-bytes``/``data-held-alone-bytes``/... on storage cells, ``data-change`` on the
per-tensor cells (the relative change ``diff --json`` reports as ``rel_l2``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from html import escape

from matplotlib import colormaps
from matplotlib.colors import to_hex

from ckstore.report import plots
from ckstore.report.data import CommitRow, Metric, ReportData, group_change
from ckstore.report.groups import TensorKey
from ckstore.report.lanes import Lane
from ckstore.report.plots import OPTIMIZER_ROW
from ckstore.runtime.units import human as human_bytes
from ckstore.version import __version__

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1400px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px}td,th{padding:2px 6px;border-bottom:1px solid #eee;text-align:right}
td.l,th.l{text-align:left}code{font-size:12px}.plot svg{max-width:100%;height:auto}
table.t td{width:9px;height:13px;padding:0;border:1px solid #fff}table.t td.n{width:auto;padding:0 6px;text-align:left}
details{margin:2px 0}summary{cursor:pointer}.flag{color:#b00}.muted{color:#777}
"""


def human(n: float | None) -> str:
    return "unknown" if n is None else human_bytes(n)


def _color(change: float | None, low: float, high: float) -> str:
    if change is None:
        return "#fff"
    if change == 0:
        return "#9ecae1"
    position = (math.log10(change) - low) / (high - low) if high > low else 1.0
    return to_hex(colormaps["magma_r"](min(1.0, max(0.0, position))))


def _range(data: ReportData) -> tuple[float, float]:
    counters = data.groups.counters
    logs = [math.log10(s.change) for r in data.commits for k, s in r.stats.items() if s.change and k not in counters]
    return (min(logs), max(logs)) if logs else (-6.0, 0.0)


def _module_table(data: ReportData, label: str, members: list[TensorKey], low: float, high: float) -> str:
    """One module's row of the tensor tables: its note and, opened, a cell per tensor and commit."""
    changing = data.groups.changing(members)
    changes = [group_change(data.commits, j, changing) for j in range(len(data.commits))] if changing else []
    known = [c for c in changes if c is not None]
    if not changing:
        note = "counters only (not a change)"
    else:
        note = "frozen" if known and max(known) == 0 else f"last change {known[-1]:.3g}" if known else "no change known"
    rows = []
    for path, name in members:
        counter = (path, name) in data.groups.counters
        cells = []
        for r in data.commits:
            s = r.stats.get((path, name))
            change = s.change if s is not None and not counter else None
            if counter:
                value = ' data-counter="1" title="a counter or scalar: its change is not shown"'
            else:
                value = "" if change is None else f' data-change="{change!r}" title="{change:.4g}"'
            cells.append(f'<td data-id="{r.id[:12]}"{value} style="background:{_color(change, low, high)}"></td>')
        shown = escape(name) + (" <span class=muted>(counter)</span>" if counter else "")
        rows.append(
            f'<tr data-path="{escape(path)}" data-name="{escape(name)}"><td class="n">{shown}</td>'
            + "".join(cells)
            + "</tr>"
        )
    return (
        f"<details><summary><code>{escape(label)}</code> · {len(members)} tensor(s) · {note}</summary>"
        f'<table class="t">{"".join(rows)}</table></details>'
    )


def _tensor_tables(data: ReportData) -> str:
    low, high = _range(data)
    out = [_module_table(data, module, members, low, high) for module, members in data.groups.modules.items()]
    if data.groups.optimizer:
        inner = "\n".join(
            _module_table(data, label, members, low, high) for label, members in data.groups.optimizer.items()
        )
        out.append(
            f"<details id=optimizer-state><summary>{OPTIMIZER_ROW} · {len(data.groups.optimizer)} parameter(s), "
            f"grouped per parameter</summary>{inner}</details>"
        )
    return "\n".join(out)


def _storage_table(data: ReportData) -> str:
    head = (
        "<tr><th>#</th><th class=l>branch</th><th class=l>commit</th><th class=l>message</th><th>logical</th><th>stored</th>"
        "<th>added</th><th>new</th><th>held alone</th><th>torch.save ≈</th></tr>"
    )
    rows = []
    for i, r in enumerate(data.commits, 1):
        figures = {
            "logical-bytes": r.commit.logical_bytes,
            "stored-bytes": r.stored_bytes,
            "added-bytes": r.commit.added_bytes,
            "new-bytes": r.sizes.new_bytes,
            "held-alone-bytes": r.sizes.held_alone_bytes,
            "torch-save-bytes": r.torch_save_bytes,
        }
        cells = "".join(f'<td data-{k}="{"" if v is None else v}">{human(v)}</td>' for k, v in figures.items())
        rows.append(
            f'<tr data-id="{r.id}" data-lane="{escape(r.lane)}"><td>{i}</td><td class=l>{escape(r.lane)}</td>'
            f"<td class=l><code>{r.id[:12]}</code></td>"
            f"<td class=l>{escape(r.commit.message.splitlines()[0] if r.commit.message else '')}</td>{cells}</tr>"
        )
    return (
        f"<details><summary>Every commit's figures ({len(rows)} rows)</summary>"
        f'<table id="storage">{head}{"".join(rows)}</table></details>'
    )


def _retention_table(data: ReportData) -> str:
    if not data.retention:
        return "<p class=muted>Too few commits for a retention policy to delete any.</p>"
    rows = "".join(
        f"<tr><td class=l><code>ckstore gc {escape(label)}</code></td><td>{n}</td>"
        f'<td data-freed-bytes="{now}">{human(now)}</td><td data-freed-prune-now-bytes="{expired}">'
        f"{human(expired)}</td></tr>"
        for label, n, now, expired in data.retention
    )
    return (
        "<table id=retention><tr><th class=l>policy</th><th>commits deleted</th><th>frees now</th>"
        f"<th>with --prune-now</th></tr>{rows}</table><p class=muted>“Frees now” keeps what the reflog still "
        "names (90 days); --prune-now expires those entries first.</p>"
    )


def _lineage(data: ReportData) -> str:
    by_id: dict[str, CommitRow] = {r.id: r for r in data.commits}

    def name(oid: str) -> str:
        row = by_id.get(oid)
        text = escape(row.commit.message.splitlines()[0]) if row and row.commit.message else ""
        return f"<code>{oid[:12]}</code> {text}"

    items = [_lane_item(data, lane, name) for lane in data.lanes]
    items += [
        f"<li>branch <b>{escape(b)}</b>{' (HEAD)' if b == data.head else ''} → {name(o)}</li>"
        for b, o in sorted(data.branches.items())
    ]
    items += [f"<li>tag <b>{escape(t)}</b> → {name(o)}</li>" for t, o in sorted(data.tags.items())]
    items += [f"<li>remote-tracking <b>{escape(t)}</b> → {name(o)}</li>" for t, o in sorted(data.tracking.items())]
    for r in data.commits:
        if r.commit.base is not None:
            where = escape(r.commit.base.repo) if r.commit.base.repo else "this repository"
            items.append(f"<li>overlay {name(r.id)} on base <code>{r.commit.base.commit[:12]}</code> in {where}</li>")
    return f"<ul id=lineage>{''.join(items)}</ul>"


def _lane_item(data: ReportData, lane: Lane, name: Callable[[str], str]) -> str:
    """How a shown branch relates to the ones before it: its own commits and its fork point."""
    own = f"{len(lane.own)} commit(s) of its own" if lane.own else "no commit of its own"
    if lane.fork is None:
        where = "" if lane is data.lanes[0] else ", an unrelated history"
    elif lane.fork_lane is not None:
        at = next(e for e in data.lanes if e.name == lane.fork_lane)
        where = f", forks from <b>{escape(lane.fork_lane)}</b> at #{at.position(lane.fork)} {name(lane.fork)}"
    else:
        where = f", forks at <code>{lane.fork[:12]}</code>, a commit gc deleted"
    return f'<li class=lane data-lane="{escape(lane.name)}" data-fork="{lane.fork or ""}">shown: <b>{escape(lane.name)}</b>, {own}{where}</li>'


def _flags(data: ReportData) -> str:
    if not data.flags:
        return "<p id=health>No non-finite values, exploding or vanishing norms, or frozen tensors that moved.</p>"
    rows = "".join(
        f'<tr data-id="{f.commit}"><td class="l flag">{escape(f.kind)}</td><td class=l><code>'
        f"{f.commit[:12]}</code></td><td class=l>{escape(f.tensor[1])} <span class=muted>"
        f"({escape(f.tensor[0])})</span></td><td class=l>{escape(f.detail)}</td></tr>"
        for f in data.flags[:500]
    )
    more = f"<p class=muted>and {len(data.flags) - 500} more</p>" if len(data.flags) > 500 else ""
    return (
        f"<table id=health><tr><th class=l>flag</th><th class=l>commit</th><th class=l>tensor</th>"
        f"<th class=l>detail</th></tr>{rows}</table>{more}"
    )


# Each metric plot costs about 0.1 s and 20 KB of page: per-layer metrics (hundreds of keys) or a
# hostile manifest (10^6) would make the page take hours; the most recorded ones are plotted.
MAX_METRIC_PLOTS = 24


def plotted_metrics(metrics: Sequence[Metric]) -> list[Metric]:
    """The metrics that get a plot: the MAX_METRIC_PLOTS recorded in the most commits (ties: in
    the order the history first records them)."""
    ranked = sorted(metrics, key=lambda m: -sum(len(s.values) for s in m.series))
    keep = {id(m) for m in ranked[:MAX_METRIC_PLOTS]}
    return [m for m in metrics if id(m) in keep]


def metrics_left_out(metrics: Sequence[Metric]) -> str:
    if len(metrics) <= MAX_METRIC_PLOTS:
        return ""
    plotted = {id(m) for m in plotted_metrics(metrics)}
    rest = [m.name for m in metrics if id(m) not in plotted]
    shown = ", ".join(escape(n) for n in rest[:20]) + (", …" if len(rest) > 20 else "")
    return f"<p class=muted>{len(rest)} more metric(s) not plotted (recorded in fewer commits): {shown}</p>"


def render(data: ReportData, refs: Sequence[str], location: str) -> str:
    labels = [r.label for r in data.commits]
    metrics = (
        "".join(
            f'<div class="plot" data-plot="metric" data-metric="{escape(m.name)}" data-best="{m.best}">'
            f"{plots.metric(m, data.lanes)}</div>"
            for m in plotted_metrics(data.metrics)
        )
        + metrics_left_out(data.metrics)
        or "<p class=muted>No numeric metric is recorded in at least two commits' metadata.</p>"
    )
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    heat = (
        f'<div class="plot" data-plot="heatmap">{plots.heatmap(data, labels)}</div>'
        if data.groups.modules or data.groups.optimizer
        else "<p class=muted>No numeric tensors.</p>"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ckstore report: {escape(" ".join(refs) or "HEAD")}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_CSS}</style></head><body>
<h1>ckstore report: {escape(" ".join(refs) or "HEAD")}</h1>
<p class=muted>{len(data.commits)} commit(s) of <code>{escape(location)}</code>, made {when} by ckstore {__version__}.</p>
<h2>Health</h2>{_flags(data)}
<h2>How much each module changed</h2>
<p>Relative change ‖Δ‖/‖parent‖ of each module (tensors grouped by name up to the last dot) from its
commit's first parent, as <code>ckstore diff</code> computes it. Open a module for its tensors.
Optimizer state is one row below the weights (opened below, per parameter); counters and other
one-element tensors are never counted as change. Columns run branch by branch, each branch's
own commits oldest first.</p>
{heat}
{_tensor_tables(data)}
<h2>Storage</h2><div class="plot" data-plot="storage">{plots.storage(data, labels)}</div>
{_storage_table(data)}
<h3>What a retention policy would free</h3>{_retention_table(data)}
<h2>Metrics</h2>{metrics}
<h2>Lineage</h2>{_lineage(data)}
</body></html>
"""

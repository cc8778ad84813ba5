"""Commands that read history: log, show, diff, stats, best."""

from __future__ import annotations

import json
from typing import Any

import click

from ..dcp_manifest import record_json
from ..repo import Repo
from .base import print_json, human, main, pass_repo


def _entry_json(oid: str, commit: Any, pruned: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "id": oid, "time": commit.time, "branch": commit.branch, "message": commit.message,
        "parents": list(commit.parents), "pruned_parents": list(pruned),
        "metadata": commit.decoded_metadata(), "logical_bytes": commit.logical_bytes,
        "added_bytes": commit.added_bytes,
    }


def _meta_text(metadata: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in metadata.items())


@main.command()
@click.argument("ref", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def log(repo: Repo, ref: str | None, as_json: bool) -> None:
    """History of REF (default HEAD), newest first."""
    entries = repo.log(ref)
    if as_json:
        print_json([_entry_json(e.id, e.commit, e.pruned_parents) for e in entries])
        return
    for e in entries:
        c = e.commit
        click.echo(f"commit {e.id}  ({c.branch})")
        click.echo(f"Date:   {c.time}")
        click.echo(f"Size:   {human(c.logical_bytes)} logical, {human(c.added_bytes)} added to the store")
        if c.decoded_metadata():
            click.echo(f"Meta:   {_meta_text(c.decoded_metadata())}")
        for parent in e.pruned_parents:
            click.echo(f"Parent: {parent[:12]} (pruned)")
        if c.message:
            click.echo(f"\n    {c.message}")
        click.echo()


@main.command()
@click.argument("ref", default="HEAD", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def show(repo: Repo, ref: str, as_json: bool) -> None:
    """Files, tensors and metadata of a commit."""
    oid, c = repo.show(ref)
    inherited = repo.from_base(oid)
    files = [
        {"path": f.path, "kind": f.kind, "size": f.size, "from_base": (f.path, None) in inherited,
         "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                      "from_base": (f.path, t.name) in inherited} for t in f.tensors]}
        for f in c.files
    ]
    if as_json:
        doc = {**_entry_json(oid, c), "base": {"commit": c.base.commit, "repo": c.base.repo} if c.base else None, "provenance": dict(c.provenance), "files": files}
        if c.state is not None:
            doc["state"] = repo.state_document(oid)
        if c.dcp is not None:
            doc["dcp"] = record_json(c.dcp)
        print_json(doc)
        return
    click.echo(f"commit {oid}  ({c.branch})\nDate:   {c.time}")
    if c.base is not None:
        click.echo(f"Base:   {c.base.commit}" + (f" in {c.base.repo}" if c.base.repo else ""))
    if c.message:
        click.echo(f"Message: {c.message}")
    if c.decoded_metadata():
        click.echo(f"Meta:   {_meta_text(c.decoded_metadata())}")
    click.echo("Provenance: " + " ".join(f"{k}={v}" for k, v in c.provenance.items()))
    if c.state is not None:
        click.echo("State:")
        for line in _state_lines(repo.state_document(oid)):
            click.echo(f"  {line}")
    if c.dcp is not None:
        _show_dcp(c.dcp)
    for f in files:
        click.echo(f"\n{f['path']}  [{f['kind']}, {human(f['size'])}{', from base' if f['from_base'] else ''}]")
        for t in f["tensors"] if c.dcp is None else ():  # a DCP commit's pieces are listed above
            click.echo(f"  {t['name']:<50} {t['dtype']:<8} {str(tuple(t['shape'])):<20}"
                       f"{' (from base)' if t['from_base'] else ''}")


def _show_dcp(record: Any) -> None:
    """A distributed checkpoint's global tensors and which rank wrote which piece."""
    click.echo(f"Distributed checkpoint: {record.world_size} rank(s), {len(record.tensors)} tensors, "
               f"{len(record.objects)} other items")
    for t in record.tensors:
        click.echo(f"  {t.fqn:<50} {t.dtype:<9} {str(t.shape):<20}")
        for p in t.pieces:
            region = ", ".join(f"{o}:{o + n}" for o, n in zip(p.offsets, p.sizes))
            click.echo(f"      rank {p.rank}: [{region}]")
    for o in record.objects:
        click.echo(f"  {o.fqn:<50} ({'typed value' if o.encoding == 'value' else 'opaque bytes'}, rank {o.rank})")


def _state_lines(value: Any) -> list[str]:
    """One line per top-level entry of a training state's typed JSON, values shortened."""
    if not isinstance(value, dict):
        return [json.dumps(value)[:100]]
    pairs = value["$dict"] if set(value) == {"$dict"} else value.items()
    lines = []
    for key, item in pairs:
        text = json.dumps(item, ensure_ascii=False)
        lines.append(f"{key}: {text if len(text) <= 100 else text[:97] + '...'}")
    return lines


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def diff(repo: Repo, a: str, b: str, as_json: bool) -> None:
    """Tensors added, removed, changed and unchanged from A to B."""
    changes = repo.diff(a, b)
    if as_json:
        print_json([vars(c) for c in changes])
        return
    marks = {"added": "+", "removed": "-", "changed": "~", "unchanged": "="}
    for c in changes:
        if c.status != "unchanged":
            cost = f"  ({human(c.stored_bytes)} stored)" if c.status in ("added", "changed") else ""
            if c.rel_l2 is not None:
                cost += f"  relative L2 change {c.rel_l2:.3g}"
            click.echo(f"{marks[c.status]} {c.path}{':' + c.name if c.name else ''}{cost}")
    counts = {s: sum(c.status == s for c in changes) for s in marks}
    total = sum(c.stored_bytes for c in changes)
    click.echo(", ".join(f"{n} {s}" for s, n in counts.items()) + f"; {human(total)} stored for the changes")


@main.command()
@click.argument("metric")
@click.option("--max", "maximize", is_flag=True, help="Higher is better (default: lower).")
@click.option("--branch", help="Branch to search (default: the current branch).")
@pass_repo
def best(repo: Repo, metric: str, maximize: bool, branch: str | None) -> None:
    """Print the id of the commit with the best METRIC in its metadata."""
    click.echo(repo.best(metric, "max" if maximize else "min", branch))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def stats(repo: Repo, as_json: bool) -> None:
    """Logical bytes, bytes on disk and their ratio."""
    s = repo.stats()
    doc = {"logical_bytes": s.logical_bytes, "stored_bytes": s.stored_bytes, "ratio": round(s.ratio, 4),
           "commits": s.commits, "objects": s.objects}
    if as_json:
        print_json(doc)
        return
    click.echo(f"commits:  {s.commits}\nobjects:  {s.objects}\nlogical:  {human(s.logical_bytes)}")
    click.echo(f"stored:   {human(s.stored_bytes)}\nratio:    {s.ratio:.3f} (stored / logical)")

"""Commands that read history: log, show, diff, stats, best.

Their figures are defined once in ckstore/maintenance/sizes.py (docs/design.md, "Size figures"); their
``--json`` fields are documented in docs/cli-json.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckstore.cli.base import complete_ref, human, main, pass_repo, print_json, short
from ckstore.errors import InvalidInputError

if TYPE_CHECKING:
    from ckstore.repo import Decorations, Repo

_STATUS_MARKS = {"added": "+", "removed": "-", "changed": "~", "unchanged": "="}


def _entry_json(oid: str, commit: Any, pruned: tuple[str, ...] = (), refs: Decorations | None = None) -> dict[str, Any]:
    from ckstore.history.log import Decorations  # loaded with the history this prints

    refs = refs or Decorations()
    return {
        "id": oid,
        "time": commit.time,
        "branch": commit.branch,
        "message": commit.message,
        "parents": list(commit.parents),
        "pruned_parents": list(pruned),
        "metadata": commit.decoded_metadata(),
        "logical_bytes": commit.logical_bytes,
        "added_bytes": commit.added_bytes,
        "head": refs.head,
        "branches": list(refs.branches),
        "tags": list(refs.tags),
        "best": list(refs.best),
    }


def meta_text(metadata: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in metadata.items())


def run_text(provenance: Any) -> str | None:
    """``MLflow: run ID (TRACKING_URI)`` for a commit made in an MLflow run, else None."""
    from ckstore.integrations.mlflow import link_in

    link = link_in(provenance)
    return f"MLflow: run {link.run_id}" + (f" ({link.tracking_uri})" if link.tracking_uri else "") if link else None


def decoration_text(refs: Decorations | None) -> str:
    """git's style: ``(HEAD -> main, exp, tag: v1, best val_loss)``, or nothing."""
    if refs is None:
        return ""
    names = [f"HEAD -> {b}" if refs.head and i == 0 else b for i, b in enumerate(refs.branches)]
    names += [f"tag: {t}" for t in refs.tags] + [f"best {m}" for m in refs.best]
    return f" ({', '.join(names)})" if names else ""


def commit_line(oid: str, commit: Any, refs: Decorations | None = None) -> str:
    """One line naming a commit: short id, names, message, metadata (log --oneline, gc)."""
    meta = meta_text(commit.decoded_metadata())
    text = f"{short(oid)}{decoration_text(refs)} {commit.message or '(no message)'}"
    return f"{text}  [{meta}]" if meta else text


@main.command()
@click.argument("ref", required=False, shell_complete=complete_ref)
@click.option("-n", "--max-count", "limit", type=click.IntRange(min=1), metavar="N", help="Show at most N commits.")
@click.option("--oneline", is_flag=True, help="One line per commit: short id, names, message, metadata.")
@click.option(
    "--sizes", is_flag=True, help="Also compute each commit's new and held-alone bytes now (reads object headers)."
)
@click.option("--best", "best_metric", metavar="METRIC", help="Mark the listed commit with the best METRIC.")
@click.option("--max", "maximize", is_flag=True, help="With --best: higher is better (default: lower).")
@click.option("--all", "all_refs", is_flag=True, help="History of every branch, tag and remote-tracking branch.")
@click.option("--graph", is_flag=True, help="Draw the lines of history beside the commits (as git log --graph).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def log(
    repo: Repo,
    ref: str | None,
    limit: int | None,
    oneline: bool,
    sizes: bool,
    best_metric: str | None,
    maximize: bool,
    all_refs: bool,
    graph: bool,
    as_json: bool,
) -> None:
    """History of REF (default HEAD), newest first, with the branches and tags pointing at each commit.
    -N is -n N (git's log -1)."""
    if all_refs and ref:
        raise InvalidInputError("log --all takes no REF")
    starts = [*repo.branches().values(), *repo.tags().values(), *repo.remote_branches().values()] if all_refs else ref
    entries = repo.log(starts or None, limit=limit, best=(best_metric, maximize) if best_metric else None)
    figures = repo.commit_sizes([e.id for e in entries]) if sizes else {}
    if as_json:
        docs = []
        for e in entries:
            doc = _entry_json(e.id, e.commit, e.pruned_parents, e.refs)
            if sizes:
                doc.update(new_bytes=figures[e.id].new_bytes, held_alone_bytes=figures[e.id].held_alone_bytes)
            docs.append(doc)
        print_json(docs)
        return
    lanes = None
    if graph:
        from ckstore.history.lanes import graph_prefixes

        lanes = graph_prefixes([(e.id, e.commit.parents) for e in entries])
    for e in entries:
        c = e.commit
        prefix, joins = next(lanes) if lanes else ("", [])
        extra = f"{human(figures[e.id].new_bytes)} new, {_held_text(figures[e.id].held_alone_bytes)}" if sizes else ""
        if oneline:
            click.echo(
                (f"{prefix} " if graph else "") + commit_line(e.id, c, e.refs) + (f"  ({extra})" if extra else "")
            )
            for line in joins:
                click.echo(line)
            continue
        if graph:
            _echo_graph_commit(prefix, joins, e, extra)
            continue
        click.echo(f"commit {e.id}{decoration_text(e.refs)}")
        click.echo(f"Date:   {c.time}")
        click.echo(
            f"Size:   {human(c.logical_bytes)} logical, {human(c.added_bytes)} added when committed"
            + (f"; {extra}" if extra else "")
        )
        if c.decoded_metadata():
            click.echo(f"Meta:   {meta_text(c.decoded_metadata())}")
        if run := run_text(c.provenance):
            click.echo(run)
        for parent in e.pruned_parents:
            click.echo(f"Parent: {short(parent)} (pruned)")
        if c.message:
            click.echo(f"\n    {c.message}")
        click.echo()


def _echo_graph_commit(prefix: str, joins: list[str], e: Any, extra: str) -> None:
    """The long format with the lanes on its left: the commit line, then its details indented."""
    c = e.commit
    rest = prefix.replace("*", "|")
    lines = [
        f"Date:   {c.time}",
        f"Size:   {human(c.logical_bytes)} logical, {human(c.added_bytes)} added when "
        f"committed" + (f"; {extra}" if extra else ""),
    ]
    if c.decoded_metadata():
        lines.append(f"Meta:   {meta_text(c.decoded_metadata())}")
    if run := run_text(c.provenance):
        lines.append(run)
    if c.message:
        lines += ["", f"    {c.message}"]
    click.echo(f"{prefix} commit {e.id}{decoration_text(e.refs)}")
    for line in lines:
        click.echo(f"{rest} {line}".rstrip())
    for line in joins or [rest]:
        click.echo(line)


def _held_text(n: int | None) -> str:
    # None: an overlay repository of this one cannot be opened (gc refuses too; fsck names it).
    return f"{human(n)} held alone now" if n is not None else "held alone unknown (a dependent repository is missing)"


@main.command()
@click.argument("ref", default="HEAD", required=False, shell_complete=complete_ref)
@click.option("--tensors", "list_tensors", is_flag=True, help="List every tensor (default: a summary per file).")
@click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable output, always with every tensor (docs/cli-json.md)."
)
@pass_repo
def show(repo: Repo, ref: str, list_tensors: bool, as_json: bool) -> None:
    """Files (summarised: tensors, dtypes, bytes, groups), metadata and provenance of a commit."""
    oid, c = repo.show(ref)
    refs = repo.decorations().get(oid)
    inherited = repo.from_base(oid)
    if as_json:
        files = [
            {
                "path": f.path,
                "kind": f.kind,
                "size": f.size,
                "from_base": (f.path, None) in inherited,
                "tensors": [
                    {
                        "name": t.name,
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "bytes": t.nbytes,
                        "from_base": (f.path, t.name) in inherited,
                    }
                    for t in f.tensors
                ],
            }
            for f in c.files
        ]
        # "repo": where the base is now, else as recorded at commit time.
        base_repo = (repo.base_location(oid) or c.base.repo) if c.base else None
        doc = {
            **_entry_json(oid, c, refs=refs),
            "base": {"commit": c.base.commit, "repo": base_repo} if c.base else None,
            "provenance": dict(c.provenance),
            "files": files,
        }
        if c.state is not None:
            doc["state"] = repo.state_document(oid)
        if c.dcp is not None:
            from ckstore.format.dcp_record import record_json

            doc["dcp"] = record_json(c.dcp)
        print_json(doc)
        return
    click.echo(f"commit {oid}{decoration_text(refs)}\nDate:   {c.time}")
    if c.base is not None:
        now = repo.base_location(oid)
        where = (
            f" in {now}"
            if now
            else f" in {c.base.repo} (recorded at commit; not reachable now: 'ckstore fsck' says why)"
            if c.base.repo
            else ""
        )
        click.echo(f"Base:   {c.base.commit}{where}")
    if c.message:
        click.echo(f"Message: {c.message}")
    if c.decoded_metadata():
        click.echo(f"Meta:   {meta_text(c.decoded_metadata())}")
    click.echo(f"Size:   {human(c.logical_bytes)} logical, {human(c.added_bytes)} added when committed")
    click.echo("Provenance: " + " ".join(f"{k}={v}" for k, v in c.provenance.items()))
    if run := run_text(c.provenance):
        click.echo(run)
    if c.state is not None:
        from ckstore.history.state_words import state_lines

        click.echo("State:")
        tensors = {t.name: t for f in c.files if f.path == c.state.tensors for t in f.tensors}
        for line in state_lines(repo.state_document(oid), tensors):
            click.echo(f"  {line}")
    if c.dcp is not None:
        _show_dcp(c.dcp)
    click.echo()
    if list_tensors and c.dcp is None:  # a DCP commit's pieces are listed above
        _print_tensors(c, inherited)
    else:
        _print_summary(repo.summary(oid))


def _counts_text(counts: Any) -> str:
    return ", ".join(f"{name} ×{n}" for name, n in counts)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Columns as wide as their widest cell, two spaces apart, no trailing spaces."""
    widths = [max(len(r[i]) for r in rows) for i in range(max(map(len, rows)))] if rows else []
    return [(indent + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r))).rstrip() for r in rows]


def _print_summary(files: list[Any]) -> None:
    out = []  # one write: a commit of 10^4 files printed line by line spent a fifth of show's time in echo
    for f in files:
        parts = [f.kind, human(f.size)]
        if f.kind == "safetensors":
            parts.append(f"{_plural(f.tensors, 'tensor')} ({_counts_text(f.dtypes)})" if f.tensors else "no tensors")
        if f.from_base:
            parts.append("from base")
        elif f.tensors_from_base:
            parts.append(f"{f.tensors_from_base} of {f.tensors} tensors from base")
        out.append(f"{f.path}  " + ", ".join(parts))
        rows = []
        for g in f.groups:
            label = "optimizer state" if g.optimizer else ""
            detail = _counts_text(g.dtypes) + (f": {_counts_text(g.leaves)}" if g.leaves else "")
            rows.append([g.name or "(other groups)", label, _plural(g.tensors, "tensor"), human(g.bytes), detail])
        if rows and not any(r[1] for r in rows):
            rows = [[r[0], *r[2:]] for r in rows]
        out.extend(_table(rows))
    if out:
        click.echo("\n".join(out))


def _print_tensors(commit: Any, inherited: set[tuple[str, str | None]]) -> None:
    rows = [
        [t.name, t.dtype, str(tuple(t.shape)), human(t.nbytes), "(from base)" if (f.path, t.name) in inherited else ""]
        for f in commit.files
        for t in f.tensors
    ]
    lines = iter(_table(rows))  # one width per column across the commit's files
    for f in commit.files:
        click.echo(f"{f.path}  {f.kind}, {human(f.size)}{', from base' if (f.path, None) in inherited else ''}")
        for _ in f.tensors:
            click.echo(next(lines))


def _show_dcp(record: Any) -> None:
    """A distributed checkpoint's global tensors and which rank wrote which piece."""
    click.echo(
        f"Distributed checkpoint: {record.world_size} rank(s), {len(record.tensors)} tensors, "
        f"{len(record.objects)} other items"
    )

    def pieces(t: Any) -> str:
        return ", ".join(
            f"rank {p.rank}"
            + (f" [{', '.join(f'{o}:{o + n}' for o, n in zip(p.offsets, p.sizes))}]" if p.sizes else "")
            for p in t.pieces
        )

    rows = [[t.fqn, t.dtype, str(tuple(t.shape)), pieces(t)] for t in record.tensors]
    rows += [
        [o.fqn, "", "", f"{'typed value' if o.encoding == 'value' else 'opaque bytes'}, rank {o.rank}"]
        for o in record.objects
    ]
    for line in _table(rows):
        click.echo(line)


@main.command()
@click.argument("a", shell_complete=complete_ref)
@click.argument("b", shell_complete=complete_ref)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def diff(repo: Repo, a: str, b: str, as_json: bool) -> None:
    """Tensors added, removed, changed and unchanged from A to B, with B's new bytes. B may be a
    folder on disk (a path with a '/', or an existing directory): the commit against those files."""
    import os

    folder = b.endswith("/") or os.path.isdir(b)
    d = repo.diff_folder(a, b) if folder else repo.diff(a, b)
    counts = d.counts()
    if as_json:
        print_json(
            {
                "a": d.a,
                "b": b if folder else d.b,
                "changes": [
                    {
                        "path": c.path,
                        "name": c.name,
                        "status": c.status,
                        "new_bytes": c.stored_bytes,
                        "rel_l2": c.rel_l2,
                    }
                    for c in d
                ],
                "totals": {**counts, "new_bytes": d.new_bytes, "header_bytes": d.header_bytes},
            }
        )
        return
    for c in d:
        if c.status != "unchanged":
            cost = f"  ({human(c.stored_bytes)} new)" if c.status in ("added", "changed") and not folder else ""
            if c.rel_l2 is not None:
                cost += f"  relative L2 change {c.rel_l2:.3g}"
            click.echo(f"{_STATUS_MARKS[c.status]} {c.path}{':' + c.name if c.name else ''}{cost}")
    if folder:
        click.echo(", ".join(f"{n} {s}" for s, n in counts.items()) + f" from {short(d.a)} to the files in {b}")
        return
    # One sentence: what B stores now that A does not, and (B a child of A) what its commit added
    # then, the figure ``log --sizes`` names the same way.
    child = repo.read_commit(d.b)
    then = f" ({human(child.added_bytes)} added when committed)" if child.parents[:1] == (d.a,) else ""
    click.echo(
        (", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no tensors")
        + f"; {short(d.b)} stores {human(d.new_bytes)} that {short(d.a)} does not{then}"
    )


@main.command()
@click.argument("metric")
@click.option("--max", "maximize", is_flag=True, help="Higher is better (default: lower).")
@click.option("--branch", help="Branch to search (default: the current branch).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def best(repo: Repo, metric: str, maximize: bool, branch: str | None, as_json: bool) -> None:
    """Print the id of the commit with the best METRIC in its metadata."""
    oid = repo.best(metric, "max" if maximize else "min", branch)
    if not as_json:
        click.echo(oid)
        return
    c = repo.read_commit(oid)
    print_json(
        {
            "id": oid,
            "metric": metric,
            "value": c.decoded_metadata()[metric],
            "mode": "max" if maximize else "min",
            "branch": branch or repo.head_branch,
            "message": c.message,
            "time": c.time,
            "metadata": c.decoded_metadata(),
        }
    )


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def stats(repo: Repo, as_json: bool) -> None:
    """Logical bytes, bytes stored (and how many of them gc would free), counts."""
    s = repo.stats()
    if as_json:
        print_json(
            {
                "logical_bytes": s.logical_bytes,
                "stored_bytes": s.stored_bytes,
                "ratio": round(s.ratio, 4),
                "commits": s.commits,
                "objects": s.objects,
                "unreferenced_bytes": s.unreferenced_bytes,
                "unreferenced_objects": s.unreferenced_objects,
                "temporary_files": s.temporary_files,
                "temporary_bytes": s.temporary_bytes,
            }
        )
        return
    click.echo(f"commits:  {s.commits}\nobjects:  {s.objects}\nlogical:  {human(s.logical_bytes)}")
    click.echo(f"stored:   {human(s.stored_bytes)}\nratio:    {s.ratio:.3f} (stored / logical)")
    if s.unreferenced_bytes is None:
        click.echo("unreferenced: unknown (a dependent repository cannot be opened; 'ckstore fsck' names it)")
    else:
        click.echo(
            f"unreferenced: {human(s.unreferenced_bytes)} in {s.unreferenced_objects} object(s) (plain gc frees this)"
        )
    if s.temporary_files:
        click.echo(
            f"temporary: {human(s.temporary_bytes)} in {s.temporary_files} file(s) (left by an interrupted "
            "write, or one running now; gc frees this)"
        )

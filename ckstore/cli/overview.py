"""Commands that look at the whole repository for a person: status and report.

Imports of what they compute stay inside the functions: ``ckstore --help`` must stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckstore.cli.base import human, main, pass_repo, print_json, short

if TYPE_CHECKING:
    from ckstore.repo import Repo


def _status_json(s: Any) -> dict[str, Any]:
    remotes: dict[str, dict[str, Any]] = {
        name: {"name": name, "url": url, "branches": []} for name, url in s.remotes.items()
    }
    for t in s.tracking:
        remotes[t.remote]["branches"].append(
            {"branch": t.branch, "tracking": t.tracking, "local": t.local, "ahead": t.ahead, "behind": t.behind}
        )
    return {
        "branch": s.branch,
        "head": s.head,
        "compaction_running": s.compaction_running,
        "at_rest": s.at_rest,
        "logical_bytes": s.stats.logical_bytes,
        "stored_bytes": s.stats.stored_bytes,
        "commits": s.stats.commits,
        "gc_would_free_bytes": s.stats.unreferenced_bytes,
        "storage_measured": _iso(s.stats_measured),
        "storage_current": s.stats_current,
        "storage_problem": s.storage_problem or None,
        "bases": [{"location": b.location, "reachable": b.reachable, "reason": b.reason} for b in s.bases],
        "remotes": list(remotes.values()),
    }


def _iso(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _tracking_text(t: Any) -> str:
    theirs = f"{t.remote}/{t.branch}"
    if t.local is None:
        return f"  {theirs} at {short(t.tracking)} (no local branch {t.branch!r})"
    if t.ahead == t.behind == 0:
        return f"  {t.branch}: up to date with {theirs}"
    parts = [f"{t.ahead} ahead" if t.ahead else "", f"{t.behind} behind" if t.behind else ""]
    return f"  {t.branch}: {', '.join(p for p in parts if p)} {theirs} (as of the last push or fetch)"


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def status(repo: Repo, as_json: bool) -> None:
    """The current branch and HEAD, background compaction, storage and what gc would free,
    overlay bases, and each remote's branches ahead or behind."""
    s = repo.status()
    if as_json:
        print_json(_status_json(s))
        return
    if s.head is None:
        click.echo(f"On branch {s.branch}: no commits yet")
    else:
        click.echo(
            f"On branch {s.branch}, HEAD {short(s.head)} {repo.read_commit(s.head, files=False).message or '(no message)'}"
        )
    click.echo(
        "compaction: running in another process (compact.lock is held)"
        if s.compaction_running
        else "compaction: none running"
    )
    if not s.at_rest:
        click.echo(
            "not yet at rest: the newest commits are not all in their best encoding yet"
            + " ('ckstore wait' settles them now)"
        )
    free = (
        "unknown (a dependent repository cannot be opened)"
        if s.stats.unreferenced_bytes is None
        else human(s.stats.unreferenced_bytes)
    )
    if s.storage_problem:
        click.echo(f"storage: not measured: {s.storage_problem} ('ckstore fsck' names every damaged object)")
    elif s.stats_current:
        click.echo(
            f"storage: {human(s.stats.stored_bytes)} stored for {human(s.stats.logical_bytes)} logical in "
            f"{s.stats.commits} commit(s); plain gc would free {free}"
        )
    else:  # commits and logical bytes are counted now; the stored figures are the last measurement's
        click.echo(
            f"storage: {s.stats.commits} commit(s), {human(s.stats.logical_bytes)} logical; "
            f"{human(s.stats.stored_bytes)} stored and plain gc would free {free} as of {_iso(s.stats_measured)}"
            " (changed since: `ckstore stats` measures it again)"
        )
    for b in s.bases:
        click.echo(f"base repository {b.location}: " + ("reachable" if b.reachable else f"UNREACHABLE: {b.reason}"))
    for name, url in s.remotes.items():
        click.echo(f"remote {name} ({url}):")
        lines = [_tracking_text(t) for t in s.tracking if t.remote == name]
        click.echo("\n".join(lines) if lines else "  nothing pushed or fetched yet")


@main.command()
@click.argument("refs", nargs=-1, metavar="[REF]...")
@click.option("-o", "--output", required=True, metavar="FILE", help="The HTML file to write (e.g. report.html).")
@pass_repo
def report(repo: Repo, refs: tuple[str, ...], output: str) -> None:
    """Write one self-contained HTML file about the history of REFs (default HEAD): how much each
    module changed per commit, storage, metric curves, lineage and health flags."""
    size = repo.report(list(refs), output)
    click.echo(f"wrote {output} ({human(size)})")

"""Commands that name commits: branch, tag, switch, reset, reflog."""

from __future__ import annotations

import fnmatch
import shlex
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import click

from ckstore.cli.base import complete_ref, main, pass_repo, print_json
from ckstore.errors import InvalidInputError

if TYPE_CHECKING:
    from ckstore.repo import ReflogEntry, Repo


def _listing_options(kind: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """git's listing switches: ``branch -a``/``-r`` (remote-tracking branches), ``tag -l [PATTERN]``."""
    if kind == "branch":
        options = [
            click.option(
                "-a",
                "--all",
                "listing",
                flag_value="all",
                help="List local and remote-tracking branches (REMOTE/BRANCH).",
            ),
            click.option(
                "-r", "--remotes", "listing", flag_value="remotes", help="List remote-tracking branches only."
            ),
        ]
    else:
        options = [
            click.option(
                "-l",
                "--list",
                "listing",
                flag_value="pattern",
                help="List tags; a NAME given is a glob pattern they must match (as git tag -l).",
            )
        ]

    def apply(f: Callable[..., None]) -> Callable[..., None]:
        for option in options:
            f = option(f)
        return f

    return apply


def _list_refs(repo: Repo, kind: str, listing: str | None, pattern: str | None, as_json: bool) -> None:
    plural = "branches" if kind == "branch" else "tags"
    local = {} if listing == "remotes" else repo.branches() if kind == "branch" else repo.tags()
    if pattern is not None:
        local = {k: v for k, v in local.items() if fnmatch.fnmatchcase(k, pattern)}
    remote = repo.remote_branches() if listing in ("all", "remotes") else {}
    if as_json:
        doc: dict[str, object] = {"current": repo.head_branch} if kind == "branch" else {}
        if listing != "remotes":
            doc[plural] = dict(sorted(local.items()))
        if listing in ("all", "remotes"):
            doc["remote_branches"] = dict(sorted(remote.items()))
        print_json(doc)
        return
    current = repo.head_branch if kind == "branch" else None
    rows = [(f"{'*' if key == current else ' '} {key}", oid) for key, oid in sorted(local.items())]
    rows += [(f"  remotes/{key}", oid) for key, oid in sorted(remote.items())]
    width = max((len(label) for label, _ in rows), default=0)
    for label, oid in rows:
        click.echo(f"{label:<{width}}  {oid[:12]}")


def _refs_command(kind: str) -> Callable[..., None]:
    force_help = f"Move an existing {kind} to REF" + (
        "; with -d, delete even the current or only branch." if kind == "branch" else "."
    )

    @click.argument("name", required=False)
    @click.argument("ref", required=False, shell_complete=complete_ref)
    @click.option("-d", "--delete", is_flag=True, help=f"Delete the {kind}.")
    @click.option("-f", "--force", is_flag=True, help=force_help)
    @_listing_options(kind)
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
    @pass_repo
    def command(
        repo: Repo, name: str | None, ref: str | None, delete: bool, force: bool, listing: str | None, as_json: bool
    ) -> None:
        if listing is not None:
            if delete or force or ref is not None or (name is not None and kind == "branch"):
                raise InvalidInputError(
                    f"{kind} {'-l takes at most a PATTERN' if kind == 'tag' else '-a/-r only list'}"
                )
            _list_refs(repo, kind, listing, name, as_json)
            return
        if delete:
            if name is None:
                raise InvalidInputError(f"{kind} -d needs a name")
            if ref:
                raise InvalidInputError(f"{kind} -d takes one name, not a REF")
            old = repo.delete_branch(name, force=force) if kind == "branch" else repo.delete_tag(name)
            restore = f"ckstore {kind} {shlex.quote(name)} {old[:12]}"
            if as_json:
                print_json({"deleted": name, "id": old})
            else:
                click.echo(f"deleted {kind} {name} (was {old[:12]}); '{restore}' restores it")
        elif name is not None:  # an empty name is refused as a name, not taken as "list"
            oid = (repo.create_branch if kind == "branch" else repo.create_tag)(name, ref or "HEAD", force=force)
            if as_json:
                print_json({"name": name, "id": oid})
            else:
                click.echo(f"{kind} {name} -> {oid}")
        else:
            _list_refs(repo, kind, None, None, as_json)

    plural = "branches" if kind == "branch" else "tags"
    command.__doc__ = (
        f"List {plural}, create {kind} NAME at REF (default HEAD; -f moves an existing one), or delete one with -d."
    )
    return command


main.command(name="branch")(_refs_command("branch"))
main.command(name="tag")(_refs_command("tag"))


@main.command()
@click.argument("name")
@click.argument("start", required=False)
@click.option("-c", "--create", is_flag=True, help="Create branch NAME at START (default HEAD) first.")
@pass_repo
def switch(repo: Repo, name: str, start: str | None, create: bool) -> None:
    """Make NAME the current branch: the one commit and reset move."""
    if start and not create:
        raise InvalidInputError("switch takes START only with -c (to create the branch there)")
    if name == repo.head_branch and not create and name in repo.branches():
        click.echo(f"already on branch {name}")
        return
    oid = repo.switch(name, (start or "HEAD") if create else None)
    click.echo(f"switched to {'a new ' if create else ''}branch {name} ({oid[:12]})")


@main.command()
@click.argument("ref", shell_complete=complete_ref)
@pass_repo
def reset(repo: Repo, ref: str) -> None:
    """Move the current branch to REF (the commit it left stays in the reflog)."""
    old, new = repo.reset(ref)
    was = f" (was {old[:12]})" if old else ""
    click.echo(f"branch {repo.head_branch} -> {new}{was}")


def _entry_json(selector: str, e: ReflogEntry) -> dict[str, object]:
    return {
        "selector": selector,
        "ref": e.ref,
        "old": e.old,
        "new": e.new,
        "time": _iso(e.time),
        "timestamp": e.time,
        "who": e.who,
        "what": e.what,
    }


def _iso(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


@main.command()
@click.argument("ref", required=False, shell_complete=complete_ref)
@click.option("-n", "--max-count", type=click.IntRange(min=1), metavar="N", help="Only the N newest entries.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def reflog(repo: Repo, ref: str | None, max_count: int | None, as_json: bool) -> None:
    """Every change of REF (a branch or tag, deleted ones too, or HEAD), newest first; of every
    ref without REF. Each line's NAME@{n} is a revision: 'ckstore branch -f NAME NAME@{1}' undoes
    the last change."""
    entries = repo.reflog(ref)[:max_count]
    if as_json:
        print_json([_entry_json(selector, e) for selector, e in entries])
        return
    for selector, e in entries:
        what = e.what if e.new is not None or e.old is None else f"{e.what} (was {e.old[:12]})"
        when = datetime.fromtimestamp(e.time).strftime("%Y-%m-%d %H:%M:%S")
        click.echo(f"{(e.new or '-')[:12]:<12}  {selector:<16} {when}  {what}")

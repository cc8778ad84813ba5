"""Commands that name commits: branch, tag."""

from __future__ import annotations

from collections.abc import Callable

import click

from ..errors import InvalidInputError
from ..repo import Repo
from .base import main, pass_repo


def _refs_command(kind: str) -> Callable[..., None]:
    @click.argument("name", required=False)
    @click.argument("ref", required=False)
    @click.option("-d", "--delete", is_flag=True, help=f"Delete the {kind}.")
    @pass_repo
    def command(repo: Repo, name: str | None, ref: str | None, delete: bool) -> None:
        listing = repo.branches() if kind == "branch" else repo.tags()
        if delete:
            if name is None:
                raise InvalidInputError(f"{kind} -d needs a name")
            (repo.delete_branch if kind == "branch" else repo.delete_tag)(name)
            click.echo(f"deleted {kind} {name}")
        elif name is not None:  # an empty name is refused as a name, not taken as "list"
            oid = (repo.create_branch if kind == "branch" else repo.create_tag)(name, ref or "HEAD")
            click.echo(f"{kind} {name} -> {oid}")
        else:
            current = repo.head_branch if kind == "branch" else None
            for key, oid in sorted(listing.items()):
                click.echo(f"{'*' if key == current else ' '} {key:<30} {oid[:12]}")

    command.__doc__ = f"List {kind}{'es' if kind == 'branch' else 's'}, create {kind} NAME at REF (default HEAD), or delete one with -d."
    return command


main.command(name="branch")(_refs_command("branch"))
main.command(name="tag")(_refs_command("tag"))

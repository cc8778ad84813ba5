"""Commands that name commits: branch, tag."""

from __future__ import annotations

from collections.abc import Callable

import click

from ..errors import InvalidInputError
from ..repo import Repo
from .base import main, pass_repo, print_json


def _refs_command(kind: str) -> Callable[..., None]:
    plural = "branches" if kind == "branch" else "tags"

    @click.argument("name", required=False)
    @click.argument("ref", required=False)
    @click.option("-d", "--delete", is_flag=True, help=f"Delete the {kind}.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
    @pass_repo
    def command(repo: Repo, name: str | None, ref: str | None, delete: bool, as_json: bool) -> None:
        listing = repo.branches() if kind == "branch" else repo.tags()
        if delete:
            if name is None:
                raise InvalidInputError(f"{kind} -d needs a name")
            (repo.delete_branch if kind == "branch" else repo.delete_tag)(name)
            if as_json:
                print_json({"deleted": name, "id": listing.get(name)})
            else:
                click.echo(f"deleted {kind} {name}")
        elif name is not None:  # an empty name is refused as a name, not taken as "list"
            oid = (repo.create_branch if kind == "branch" else repo.create_tag)(name, ref or "HEAD")
            if as_json:
                print_json({"name": name, "id": oid})
            else:
                click.echo(f"{kind} {name} -> {oid}")
        elif as_json:
            doc: dict[str, object] = {"current": repo.head_branch} if kind == "branch" else {}
            print_json({**doc, plural: dict(sorted(listing.items()))})
        else:
            current = repo.head_branch if kind == "branch" else None
            width = max(map(len, listing), default=0)
            for key, oid in sorted(listing.items()):
                click.echo(f"{'*' if key == current else ' '} {key:<{width}}  {oid[:12]}")

    command.__doc__ = f"List {plural}, create {kind} NAME at REF (default HEAD), or delete one with -d."
    return command


main.command(name="branch")(_refs_command("branch"))
main.command(name="tag")(_refs_command("tag"))

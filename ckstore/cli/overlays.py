"""Commands that look after the links between overlay and base repositories: relink."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckstore.cli.base import main, pass_repo

if TYPE_CHECKING:
    from ckstore.repo import Repo
    from ckstore.repository.overlay import RelinkReport


@main.command()
@click.argument("bases", nargs=-1, metavar="[BASE_LOCATION]...")
@click.option(
    "--dependent",
    "dependents",
    multiple=True,
    metavar="LOCATION",
    help="An overlay repository's new location: relink it to this repository (repeatable).",
)
@click.option("--prune", is_flag=True, help="Forget dependent repositories that no longer exist (deleted overlays).")
@pass_repo
def relink(repo: Repo, bases: tuple[str, ...], dependents: tuple[str, ...], prune: bool) -> None:
    """Repair overlay links after a repository moved: point this overlay at its base's new
    location (both sides are rewritten); without arguments, rewrite the links that still open."""
    report = repo.relink(bases, dependents=dependents, prune=prune)
    _print_report(report)
    if not (bases or dependents or prune or report.bases):
        click.echo("nothing to relink: this repository has no base repository")
    if prune and not report.pruned:
        click.echo("no dependent to forget: every one listed is still there")


def _print_report(report: RelinkReport) -> None:
    for base in report.bases:
        change = "unchanged" if base.old_entry == base.new_entry else f"was {base.old_entry}"
        click.echo(f"{report.repository}: base {base.location} recorded as {base.new_entry} ({change})")
        for entry in base.forgotten:
            click.echo(f"{base.location}: forgot the old dependent entry {entry}")
    for dependent in report.dependents:
        _print_report(dependent)
    for location in report.pruned:
        click.echo(f"{report.repository}: forgot dependent {location} (no repository there)")

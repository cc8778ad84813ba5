"""Commands that look after a repository: gc, repack, config, fsck."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckstore.cli.base import die, human, main, pass_repo, print_json, progress_factory
from ckstore.cli.inspect import commit_line
from ckstore.errors import BaseUnreachableError, IntegrityError, InvalidInputError

if TYPE_CHECKING:
    from ckstore.repo import Repo


@main.command()
@click.option("--keep-last", type=int, metavar="N", help="Keep the N newest commits of every branch.")
@click.option("--keep-best", type=int, metavar="N", help="Keep the N best commits of every branch by --metric.")
@click.option("--metric", metavar="NAME", help="Metadata metric for --keep-best (lower is better unless --max).")
@click.option("--max", "maximize", is_flag=True, help="Higher --metric is better.")
@click.option(
    "--keep-every", type=int, metavar="K", help="Keep every K-th commit (by step/epoch metadata, else position)."
)
@click.option(
    "--branch",
    "branches",
    multiple=True,
    metavar="NAME",
    help="Apply the --keep-* options to branch NAME only (repeatable); other branches keep every commit.",
)
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@click.option("--repack", is_flag=True, help="Re-encode the kept objects first (newest commits whole).")
@click.option(
    "--prune-now", is_flag=True, help="Expire now every reflog entry the refs no longer reach, so its commits go too."
)
@click.option(
    "--force", is_flag=True, help="Run even if it would delete every commit, or commits --keep-best cannot rank."
)
@click.option(
    "--remote",
    "remote_name",
    metavar="NAME",
    help="Collect remote NAME instead (two-phase: packs go a grace period after they are found unneeded).",
)
@click.option(
    "--grace",
    type=float,
    metavar="SECONDS",
    help="With --remote: the grace period (default 3600; must exceed the longest push).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def gc(
    repo: Repo,
    keep_last: int | None,
    keep_best: int | None,
    metric: str | None,
    maximize: bool,
    keep_every: int | None,
    branches: tuple[str, ...],
    dry_run: bool,
    repack: bool,
    prune_now: bool,
    force: bool,
    remote_name: str | None,
    grace: float | None,
    as_json: bool,
) -> None:
    """Delete old commits (with retention options; tags are always kept) and unneeded objects.

    Commits that a branch or tag no longer names stay while the reflog names them (30 days by
    default, see 'ckstore config'); --prune-now deletes them now."""
    for flag, value in (("--keep-last", keep_last), ("--keep-best", keep_best), ("--keep-every", keep_every)):
        if value is not None and value < 1:
            raise InvalidInputError(f"{flag} must be at least 1")
    if keep_best is not None and not metric:
        raise InvalidInputError("--keep-best needs --metric NAME")
    if branches and keep_last is None and keep_best is None and keep_every is None:
        raise InvalidInputError("--branch limits a --keep-last, --keep-best or --keep-every option; give one")
    if remote_name is not None:
        if branches:
            raise InvalidInputError("--branch applies to local gc only, not with --remote")
        from ckstore.cli.remotes import report_remote_gc

        report_remote_gc(
            repo.gc_remote(
                remote_name,
                keep_last=keep_last,
                keep_best=keep_best,
                metric=metric,
                maximize=maximize,
                keep_every=keep_every,
                dry_run=dry_run,
                **({"grace": grace} if grace is not None else {}),
            ),
            as_json,
        )
        return
    # Read before gc deletes them: the report names each commit by its message and metadata.
    doomed = {oid: repo.read_commit(oid, files=False) for oid in repo.reachable_commits()}
    report = repo.gc(
        keep_last=keep_last,
        keep_best=keep_best,
        metric=metric,
        maximize=maximize,
        keep_every=keep_every,
        branches=branches or None,
        dry_run=dry_run,
        repack=repack,
        prune_now=prune_now,
        force=force,
        progress=progress_factory(),
        notify=lambda message: click.echo(f"ckstore: {message}", err=True),
    )
    deleted = [*report.pruned_commits, *report.unreachable_commits]
    # A commit made while gc waited for the lock, or one only an expired reflog entry named, is
    # named by its id alone.
    known = [(oid, doomed.get(oid)) for oid in deleted]
    known.sort(key=lambda k: (k[1] is None, k[1].timestamp if k[1] else 0.0, k[0]))  # oldest first
    if as_json:
        print_json(
            {
                "dry_run": dry_run,
                "pruned_commits": [
                    {
                        "id": oid,
                        "time": c.time if c else None,
                        "message": c.message if c else None,
                        "metadata": c.decoded_metadata() if c else None,
                    }
                    for oid, c in known
                ],
                "expired_reflog_entries": report.expired_entries,
                "reflog_only_commits": report.reflog_commits,
                "overlay_base_commits": report.overlay_commits,
                "deletes_every_commit": report.deletes_every_commit,
                "deleted_objects": report.deleted_objects,
                "temporary_files": report.temp_files,
                "temporary_bytes": report.temp_bytes,
                "freed_bytes": report.freed_bytes,
                "unranked_commits": report.unranked_commits,
                "left_objects": report.left_objects,
                "left_bytes": report.left_bytes,
            }
        )
        return
    verb = "would delete" if dry_run else "deleted"
    unranked = set(report.unranked_commits)
    for oid, c in known:
        mark = f"  (no {metric} to rank it by)" if oid in unranked else ""
        click.echo(f"{verb} commit {commit_line(oid, c) if c else oid}{mark}")
    if unranked:
        click.echo(
            f"{len(unranked)} commit(s) record no numeric {metric!r}: --keep-best "
            f"{'would delete' if dry_run else 'deleted'} them without ranking them"
            + (" (gc needs --force for that)" if dry_run else "")
        )
    if report.expired_entries:
        click.echo(
            f"{'would expire' if dry_run else 'expired'} {report.expired_entries} reflog entr"
            f"{'y' if report.expired_entries == 1 else 'ies'}"
        )
    if report.reflog_commits:
        click.echo(
            f"kept {len(report.reflog_commits)} commit(s) that only the reflog names ('ckstore reflog');"
            " 'ckstore gc --prune-now' deletes them"
        )
    if report.overlay_commits:  # kept without a word before
        click.echo(
            f"kept {len(report.overlay_commits)} commit(s) outside the policy that overlay repositories use "
            "as their base ('ckstore fsck' lists the dependents)"
        )
    if report.deletes_every_commit:
        click.echo(
            "this gc would delete every commit of the repository (it needs --force)"
            if dry_run
            else "deleted every commit of the repository"
        )
    temporary = f" and {report.temp_files} temporary file(s)" if report.temp_files else ""
    objects = f", {report.deleted_objects} object(s)" if temporary else f" and {report.deleted_objects} object(s)"
    click.echo(
        f"{verb} {len(deleted)} commit(s){objects}{temporary}, "
        f"{'would free' if dry_run else 'freed'} {human(report.freed_bytes)}"
    )
    if report.left_objects:
        click.echo(
            f"left {report.left_objects} object(s), {human(report.left_bytes)}, for want of space"
            f" ({report.no_space}); run 'ckstore gc' again to delete them"
        )


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def repack(repo: Repo, as_json: bool) -> None:
    """Re-encode every kept object with the current settings: newest commits whole, older ones deltas."""
    r = repo.repack(progress=progress_factory())
    if as_json:
        print_json(
            {
                "upgraded": r.upgraded,
                "objects": r.objects,
                "rewritten": r.rewritten,
                "deltas": r.deltas,
                "stored_bytes_before": r.stored_bytes_before,
                "stored_bytes_after": r.stored_bytes_after,
            }
        )
        return
    if r.upgraded:
        click.echo("upgraded the repository to format version 2")
    saved = r.stored_bytes_before - r.stored_bytes_after
    click.echo(
        f"repacked {r.objects} chunk object(s): {r.rewritten} re-encoded, {r.objects - r.rewritten} unchanged; "
        f"{r.deltas} stored as deltas"
    )
    click.echo(
        f"stored: {human(r.stored_bytes_before)} before, {human(r.stored_bytes_after)} after "
        f"({'saved ' + human(saved) if saved >= 0 else 'grew by ' + human(-saved)})"
    )


_SETTINGS = ("chunk_size", "zstd_level", "max_delta_depth", "reflog_expire_days", "reflog_expire_unreachable_days")


@main.command(name="config")
@click.argument("key", required=False, type=click.Choice(_SETTINGS))
@click.argument("value", required=False, type=int)
@pass_repo
def config_command(repo: Repo, key: str | None, value: int | None) -> None:
    """Show the repository settings, or set KEY to VALUE (applies to objects written later)."""
    from dataclasses import replace

    if key is None:
        for name in ("version", *_SETTINGS):
            click.echo(f"{name} = {getattr(repo.config, name)}")
        return
    if value is None:
        click.echo(getattr(repo.config, key))
        return
    if key == "max_delta_depth" and repo.config.version < 2:
        raise InvalidInputError("a version-1 repository has no deltas; run 'ckstore repack' to upgrade it first")
    changes: dict[str, Any] = {key: value}  # key is one of _SETTINGS (all int fields)
    repo.set_config(replace(repo.config, **changes))
    click.echo(f"{key} = {value}")


@main.command()
@click.option("--read-data", is_flag=True, help="Also decompress and re-hash every object.")
@click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md); exit code as without."
)
@pass_repo
def fsck(repo: Repo, read_data: bool, as_json: bool) -> None:
    """Check that every ref, manifest and object is present and sound.

    Exit 4 when something is damaged or missing; exit 3 when the only problem is an overlay's
    base repository that cannot be opened (moved: 'ckstore relink NEW_LOCATION' reconnects it).
    """
    problems = repo.fsck(read_data=read_data, progress=progress_factory() if read_data else None)
    if as_json:
        print_json(
            {
                "ok": not problems,
                "read_data": read_data,
                "problems": problems,
                "unreachable_bases": problems.unreachable_bases,
            }
        )
    else:
        for problem in problems:
            click.echo(problem)
    if problems.only_unreachable_bases:  # nothing found damaged: data out of reach until relink
        die(f"{len(problems)} problem(s) found: base repository unreachable", BaseUnreachableError.exit_code)
    if problems:
        die(f"{len(problems)} problem(s) found", IntegrityError.exit_code)
    if not as_json:
        click.echo("no problems found" + (" (all data re-hashed)" if read_data else ""))

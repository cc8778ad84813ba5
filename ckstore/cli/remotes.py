"""Commands for remotes: remote add/remove/list, push, fetch, pull, clone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckstore.cli.base import find_repo, human, main, pass_repo, print_json, progress_factory, short

if TYPE_CHECKING:
    from ckstore.remote.fetch import FetchReport
    from ckstore.remote.gc import RemoteGcReport
    from ckstore.repo import Repo


@main.group(invoke_without_command=True)
@click.option("-v", "--verbose", is_flag=True, help="Show each remote's URL (and endpoint).")
@click.pass_context
def remote(ctx: click.Context, verbose: bool) -> None:
    """List remotes, or add and remove them (credentials come from the AWS environment, never stored)."""
    if ctx.invoked_subcommand is not None:
        return
    repo = find_repo(ctx)
    from ckstore.transport.awsconfig import redact  # a remotes file from before URLs with passwords were refused

    for name, spec in sorted(repo.remotes().items()):
        if verbose:
            endpoint = f"\t(endpoint {redact(spec.endpoint_url)})" if spec.endpoint_url else ""
            click.echo(f"{name}\t{redact(spec.url)}{endpoint}")
        else:
            click.echo(name)


@remote.command("add")
@click.argument("name")
@click.argument("url")
@click.option(
    "--endpoint-url", metavar="URL", help="S3 endpoint (else AWS_ENDPOINT_URL, the AWS config, or AWS itself)."
)
@pass_repo
def remote_add(repo: Repo, name: str, url: str, endpoint_url: str | None) -> None:
    """Add remote NAME at URL: s3://bucket/prefix, a folder path, or file:///folder."""
    spec = repo.add_remote(name, url, endpoint_url)
    click.echo(f"added remote {spec.name} ({spec.url})")


@remote.command("remove")
@click.argument("name")
@pass_repo
def remote_remove(repo: Repo, name: str) -> None:
    """Forget remote NAME and its remote-tracking refs (the remote itself is not touched)."""
    spec = repo.remove_remote(name)
    click.echo(f"removed remote {spec.name} ({spec.url})")


@main.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False)
@click.argument("refs", nargs=-1)
@click.option("--force", is_flag=True, help="Overwrite remote branches that are not ancestors (and move tags).")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help=(
        "How long a superseded pack this push cannot delete at once (an equal copy another push sent) "
        "stays before a later push deletes it (default 3600)."
    ),
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def push(
    repo: Repo, remote_name: str | None, refs: tuple[str, ...], force: bool, grace: float | None, as_json: bool
) -> None:
    """Send REFs (default: the current branch) to REMOTE (default: origin), only what it lacks,
    and what local compaction re-encoded smaller since (the packs it replaces are deleted at once)."""
    r = repo.push(remote_name, list(refs), force=force, grace=grace, progress=progress_factory())
    if as_json:
        print_json(
            {
                "remote": r.remote,
                "updated": [{"ref": ref, "old": old, "new": new} for ref, old, new in r.updated],
                "up_to_date": r.up_to_date,
                "objects": r.objects,
                "packs": r.packs,
                "bytes": r.bytes,
                "resent_objects": r.resent_objects,
                "resent_bytes": r.resent_bytes,
                "condemned": r.condemned,
                "deleted": r.deleted,
                "freed_bytes": r.freed_bytes,
            }
        )
        return
    for ref, old, new in r.updated:
        click.echo(f"{ref}: {short(old) if old else '(new)'} -> {short(new)}")
    for ref in r.up_to_date:
        click.echo(f"{ref}: up to date")
    click.echo(f"sent {r.objects} object(s) in {r.packs} pack(s), {human(r.bytes)} to {r.remote}")
    if r.resent_objects or r.condemned or r.deleted:
        click.echo(
            f"of which {r.resent_objects} object(s), {human(r.resent_bytes)}, smaller copies of what it held; "
            f"{len(r.condemned)} superseded pack(s) condemned, {len(r.deleted)} deleted ({human(r.freed_bytes)} freed)"
        )


def _fetched(r: FetchReport) -> None:
    for ref, old, new in r.updated:
        click.echo(f"{ref}: {short(old) if old else '(new)'} -> {short(new)}")
    click.echo(f"fetched {r.commits} commit(s), {r.objects} object(s), {human(r.bytes)} from {r.remote}")
    for s in r.skipped:
        if not s.damaged:  # damaged ones are the error below
            click.echo(f"ckstore: warning: skipped {s.ref}: {s.reason}", err=True)


@main.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False)
@pass_repo
def fetch(repo: Repo, remote_name: str | None) -> None:
    """Fetch REMOTE's branches (as REMOTE/BRANCH) and tags with every object they need."""
    r = repo.fetch(remote_name, progress=progress_factory())
    _fetched(r)
    r.check()


@main.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False)
@pass_repo
def pull(repo: Repo, remote_name: str | None) -> None:
    """Fetch, then fast-forward the current branch to REMOTE/BRANCH."""
    r, old, new = repo.pull(remote_name, progress=progress_factory())
    _fetched(r)
    if old == new:
        click.echo(f"{repo.head_branch}: already up to date")
    else:
        click.echo(f"{repo.head_branch}: fast-forward {short(old) if old else '(new)'} -> {short(new or '')}")
    r.check()


@main.command()
@click.argument("url")
@click.argument("path", default=".ckstore", required=False)
@click.option(
    "--endpoint-url", metavar="URL", help="S3 endpoint (else AWS_ENDPOINT_URL, the AWS config, or AWS itself)."
)
def clone(url: str, path: str, endpoint_url: str | None) -> None:
    """Create a repository at PATH (default ./.ckstore) with every branch of the remote at URL."""
    from ckstore.repo import Repo

    repo, r = Repo.clone(url, path, endpoint_url=endpoint_url, progress=progress_factory(), check=False)
    click.echo(f"cloned {url} into {repo.path}: {len(repo.branches())} branch(es)")
    _fetched(r)
    r.check()


def report_remote_gc(r: RemoteGcReport, as_json: bool) -> None:
    """Output of ``gc --remote`` (the option lives on ``gc``, in maintenance.py)."""
    if as_json:
        doc = {
            k: getattr(r, k)
            for k in (
                "remote",
                "dry_run",
                "live_objects",
                "condemned",
                "deleted",
                "freed_bytes",
                "rescued",
                "resent_objects",
                "resent_bytes",
            )
        }
        print_json({**doc, "pruned_commits": [{"id": oid} for oid in r.pruned_commits]})
        return
    verb = "would delete" if r.dry_run else "deleted"
    click.echo(
        f"remote {r.remote}: {r.live_objects} live object(s); {len(r.pruned_commits)} commit(s) pruned by "
        f"the retention policy; {verb} {len(r.deleted)} pack(s), {human(r.freed_bytes)}; "
        f"{len(r.condemned)} pack(s) newly found unneeded (deleted by a gc after the grace period)"
    )
    if r.resent_objects:
        click.echo(
            f"uploaded {r.resent_objects} smaller re-encoded object(s) ({human(r.resent_bytes)}) to replace "
            "bigger copies on the remote"
        )
    if r.condemned and not r.deleted and not r.dry_run:  # say why nothing went
        click.echo(
            "packs found unneeded are deleted only once they have stayed unneeded for the grace period "
            "(default 1 h, --grace SECONDS), by a later 'ckstore gc --remote'"
        )

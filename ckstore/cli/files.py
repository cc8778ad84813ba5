"""Commands that move files in and out: init, commit, checkout, export, import."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ckstore.cli.base import (
    INTERRUPT_NOTE,
    complete_ref,
    human,
    main,
    parse_meta,
    pass_repo,
    print_json,
    progress_factory,
)
from ckstore.errors import InvalidInputError, PickleCheckpointError

if TYPE_CHECKING:
    from ckstore.repo import CheckoutResult, Repo


@main.command()
@click.argument("path", required=False)
@click.option("--chunk-size", type=int, help="Chunk size in bytes (default 1 MiB).")
@click.option("--zstd-level", type=int, help="zstd compression level (default 1).")
@click.option("--max-delta-depth", type=int, help="Longest delta chain, 0 for no deltas (default 4).")
def init(path: str | None, chunk_size: int | None, zstd_level: int | None, max_delta_depth: int | None) -> None:
    """Create a repository at PATH (default: --repo, else ./.ckstore)."""
    from ckstore.repo import Repo

    # `ckstore --repo X init` creates X, as every other command then finds it there.
    repo_option = click.get_current_context().find_root().params.get("repo_path")
    if path is not None and repo_option is not None and Path(path).resolve() != Path(repo_option).resolve():
        raise click.UsageError(f"init got two places: PATH {path!r} and --repo {repo_option!r}; give one")
    repo = Repo.init(
        path or repo_option or ".ckstore", chunk_size=chunk_size, zstd_level=zstd_level, max_delta_depth=max_delta_depth
    )
    click.echo(f"initialised empty ckstore repository in {repo.path}")


_branch_option = click.option(
    "--branch",
    help="Branch to commit to (default: the current branch); a branch that does not exist yet starts at "
    "HEAD, as after 'git checkout -b' (the commit's parent is HEAD's commit).",
)
_orphan_option = click.option(
    "--orphan", is_flag=True, help="With --branch NEW: start NEW with a root commit, a history unrelated to HEAD's."
)


def _new_branch_start(repo: Repo, branch: str | None, orphan: bool) -> str | None:
    """Where a new ``--branch`` starts: HEAD (git's checkout -b), or nowhere with ``--orphan``."""
    if orphan and (branch is None or branch in repo.branches()):
        raise InvalidInputError("--orphan starts a new branch: name one that does not exist with --branch NEW")
    return None if orphan else "HEAD"


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("-m", "--message", default="", help="Commit message.")
@_branch_option
@_orphan_option
@click.option("--meta", multiple=True, metavar="KEY=VALUE", help="Typed metadata (repeatable).")
@click.option("--base", metavar="REF", help="Record the commit as an overlay on this base commit.")
@click.option("--base-repo", metavar="PATH", help="Repository holding --base (referenced, not copied).")
@click.option("--raw", is_flag=True, help="Store pickle checkpoints as opaque files (else: use 'ckstore import').")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def commit(
    repo: Repo,
    paths: tuple[str, ...],
    message: str,
    branch: str | None,
    orphan: bool,
    meta: tuple[str, ...],
    base: str | None,
    base_repo: str | None,
    raw: bool,
    as_json: bool,
) -> None:
    """Record safetensors files or directories as one commit; print its id.

    With MLFLOW_RUN_ID set (and MLFLOW_TRACKING_URI), the commit is linked to that MLflow run."""
    from ckstore.integrations.mlflow import autolog_from_environment

    autolog_from_environment()
    if base_repo and not base:
        base = "HEAD"
    try:
        oid = repo.commit(
            list(paths),
            message=message,
            branch=branch,
            metadata=parse_meta(meta),
            progress=progress_factory(),
            base=base,
            base_repo=base_repo,
            raw=raw,
            start=_new_branch_start(repo, branch, orphan),
        )
    except PickleCheckpointError as exc:
        raise PickleCheckpointError(
            f"{exc.path} is a PyTorch pickle checkpoint: 'ckstore import {exc.path}' stores "
            "its tensors safely; --raw commits it as one opaque file"
        ) from None
    if as_json:
        c = repo.read_commit(oid)
        print_json(
            {
                "id": oid,
                "branch": c.branch,
                "message": c.message,
                "logical_bytes": c.logical_bytes,
                "added_bytes": c.added_bytes,
            }
        )
    else:
        click.echo(oid)


@main.command()
@click.argument("ref", shell_complete=complete_ref)
@click.option("-o", "--output", "out_dir", required=True, metavar="DIR", help="Directory to write into.")
@click.option("--force", is_flag=True, help="Overwrite existing files that differ.")
@click.option("--only", multiple=True, metavar="PATTERN", help="Only tensors matching this glob (repeatable).")
@click.option(
    "--shard-size",
    metavar="SIZE",
    help="Write Hugging Face shards of at most SIZE (500MB, 2GiB, bytes) with model.safetensors.index.json"
    " (all top-level safetensors files; 'ckstore export' writes only the model).",
)
@click.option("--merge-lora", is_flag=True, help="Write the base model with the commit's PEFT LoRA adapter merged in.")
@click.option(
    "--remote",
    "remote_name",
    metavar="NAME",
    help="Read what this repository lacks from remote NAME, only the chunks needed (REF may be NAME/BRANCH).",
)
@click.option(
    "--fsync",
    is_flag=True,
    help="Make the files durable before returning (by default they are written as cp or git writes them).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def checkout(
    repo: Repo,
    ref: str,
    out_dir: str,
    force: bool,
    only: tuple[str, ...],
    shard_size: str | None,
    merge_lora: bool,
    remote_name: str | None,
    fsync: bool,
    as_json: bool,
) -> None:
    """Write the files of REF into DIR, byte-identical to what was committed."""
    if merge_lora and (shard_size is not None or only):
        raise InvalidInputError("--merge-lora cannot be combined with --shard-size or --only")
    if remote_name is not None:
        repo.use_remote(remote_name)
    result = repo.checkout(
        ref,
        out_dir,
        force=force,
        only=list(only) or None,
        progress=progress_factory(),
        shard_size=shard_size,
        merge_lora=merge_lora,
        fsync=fsync,
    )
    if as_json:
        print_json(
            {
                "commit": repo.resolve(ref),
                "output": out_dir,
                "written": result.written,
                "unchanged": result.unchanged,
                "bytes_written": result.bytes_written,
                "removed": result.removed,
            }
        )
        return
    _report_written(result)


def _report_written(result: CheckoutResult) -> None:
    click.echo(
        f"wrote {len(result.written)} file(s), {human(result.bytes_written)}"
        + (f"; {len(result.unchanged)} already up to date" if result.unchanged else "")
        + (f"; removed {', '.join(result.removed)} (the model's other layout)" if result.removed else "")
    )


@main.command()
@click.argument("ref", shell_complete=complete_ref)
@click.option("-o", "--output", "out_dir", required=True, metavar="DIR", help="Directory to write into.")
@click.option(
    "--prefix",
    metavar="KEY",
    help="Export the tensors under KEY, without it (a training state: default 'model'; e.g. 'module.').",
)
@click.option(
    "--weights",
    multiple=True,
    metavar="GLOB",
    help="Safetensors files holding the model (default: model.safetensors and its shards).",
)
@click.option(
    "--files-from", metavar="REF", help="Copy config and tokenizer files from REF instead (e.g. the base model)."
)
@click.option("--shard-size", metavar="SIZE", help="Write Hugging Face shards of at most SIZE (500MB, 2GiB, bytes).")
@click.option("--force", is_flag=True, help="Overwrite existing files that differ.")
@click.option(
    "--fsync",
    is_flag=True,
    help="Make the files durable before returning (by default they are written as cp or git writes them).",
)
@pass_repo
def export(
    repo: Repo,
    ref: str,
    out_dir: str,
    prefix: str | None,
    weights: tuple[str, ...],
    files_from: str | None,
    shard_size: str | None,
    force: bool,
    fsync: bool,
) -> None:
    """Write exactly the model of REF as a folder that from_pretrained loads.

    The model's tensors (not the optimizer's) go into model.safetensors or shards, with the
    config, tokenizer and other non-training files of REF (or of --files-from REF). A PEFT
    LoRA adapter in REF (an adapter overlay) is merged into the base weights, as checkout
    --merge-lora writes them; the adapter's files are not copied.
    """
    result = repo.export(
        ref,
        out_dir,
        prefix=prefix,
        weights=list(weights) or None,
        files_from=files_from,
        shard_size=shard_size,
        force=force,
        progress=progress_factory(),
        fsync=fsync,
    )
    _report_written(result)
    if result.merged_adapter:
        click.echo(f"merged the LoRA adapter {result.merged_adapter} into the model (not copied)")
    if "config.json" not in result.written + result.unchanged:
        click.echo(
            "ckstore: warning: the export has no config.json, which from_pretrained needs; "
            "--files-from REF copies one from a commit that has it (the base model)",
            err=True,
        )


def _last_source_note(repo: Repo, printed: int) -> str:
    """Whether the source of the commit recorded last was deleted, for the interrupt's message:
    a commit that landed before its line was printed may or may not have had its file deleted."""
    from ckstore.format.values import decode_value

    recorded = repo.commits_recorded()
    if len(recorded) <= printed:
        return ""
    meta = decode_value(repo.read_commit(recorded[-1]).metadata)
    source = meta.get("source") if isinstance(meta, dict) else None
    if not isinstance(source, str):
        return ""
    kept = os.path.lexists(source)
    return (
        f"; its source {source} was {'kept (import it again only if you want a second commit)' if kept else 'deleted'}"
    )


@main.command(name="import")
@click.argument("path")
@click.option("--recursive", is_flag=True, help="Import every .pth/.pt/.bin/.ckpt file under the folder PATH.")
@click.option("-m", "--message", default=None, help="Commit message (default: the file's name).")
@_branch_option
@_orphan_option
@click.option("--delete-source", is_flag=True, help="Delete each file once its commit is verified.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli-json.md).")
@pass_repo
def import_(
    repo: Repo,
    path: str,
    recursive: bool,
    message: str | None,
    branch: str | None,
    orphan: bool,
    delete_source: bool,
    as_json: bool,
) -> None:
    """Convert PyTorch pickle checkpoints into commits, safely (torch weights_only, never full pickle).

    With MLFLOW_RUN_ID set, each commit is linked to that MLflow run, as for commit."""
    from ckstore.integrations.mlflow import autolog_from_environment

    autolog_from_environment()
    # Printed as each file lands: if a later file is refused, the commits made so far are known
    # (with --json, the document lists them before the error line reaches stderr).
    done = []
    start = _new_branch_start(repo, branch, orphan)
    try:
        for result in repo.iter_import(
            path, recursive=recursive, message=message, branch=branch, delete_source=delete_source, start=start
        ):
            done.append({"commit": result.commit, "source": str(result.source), "deleted": result.deleted})
            if not as_json:
                click.echo(f"{result.commit}  {result.source}{'  (source deleted)' if result.deleted else ''}")
    except KeyboardInterrupt:
        if delete_source:
            click.get_current_context().meta[INTERRUPT_NOTE] = _last_source_note(repo, len(done))
        raise
    finally:
        if as_json:
            print_json({"imported": done})

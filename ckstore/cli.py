"""The ``ckstore`` command: parse arguments, call ``Repo``, print. No storage work happens here.

Errors are the contract: every ``CkstoreError`` becomes ``ckstore: <one line>`` on stderr and its
class's exit code (see errors.py); no traceback reaches the user.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import update_wrapper
from typing import Any, NoReturn

import click

from .errors import CkstoreError, IntegrityError, InvalidInputError, StorageError
from .repo import ProgressBar, Repo

EXIT_INTERRUPTED = 130


def _die(message: str, code: int) -> NoReturn:
    click.echo(f"ckstore: {message}", err=True)
    sys.exit(code)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_meta_value(text: str) -> Any:
    """``--meta`` values are typed: ints and floats stay numbers, true/false booleans, else str."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _parse_meta(pairs: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--meta expects KEY=VALUE, got {pair!r}")
        out[key] = parse_meta_value(value)
    return out


def _progress() -> Callable[[int, str], ProgressBar] | None:
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    def make(total: int, desc: str) -> ProgressBar:
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)

    return make


def _json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, ensure_ascii=False, default=str))


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkstoreError as exc:
            _die(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            _die("interrupted", EXIT_INTERRUPTED)
        except OSError as exc:
            _die(str(StorageError(f"{exc.strerror or exc}: {exc.filename or ''}")), StorageError.exit_code)
        except MemoryError:
            _die("out of memory", 1)


def pass_repo(f: Callable[..., Any]) -> Callable[..., Any]:
    """Find the repository when the command runs (so `ckstore CMD --help` works anywhere)."""

    @click.pass_context
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        return ctx.invoke(f, Repo.find(ctx.find_root().params.get("repo_path")), *args, **kwargs)

    return update_wrapper(wrapper, f)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--repo", "repo_path", metavar="PATH", help="Repository (default: $CKSTORE_REPO, else the nearest .ckstore).")
@click.version_option(package_name="ckstore")
@click.pass_context
def main(ctx: click.Context, repo_path: str | None) -> None:
    """ckstore: a content-addressed, deduplicating store for training checkpoints."""


@main.command()
@click.argument("path", default=".ckstore", required=False)
@click.option("--chunk-size", type=int, help="Chunk size in bytes (default 1 MiB).")
@click.option("--zstd-level", type=int, help="zstd compression level (default 1).")
@click.option("--max-delta-depth", type=int, help="Longest delta chain, 0 for no deltas (default 4).")
def init(path: str, chunk_size: int | None, zstd_level: int | None, max_delta_depth: int | None) -> None:
    """Create a repository at PATH (default ./.ckstore)."""
    repo = Repo.init(path, chunk_size=chunk_size, zstd_level=zstd_level, max_delta_depth=max_delta_depth)
    click.echo(f"initialised empty ckstore repository in {repo.path}")


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("-m", "--message", default="", help="Commit message.")
@click.option("--branch", help="Branch to commit to (default: the current branch).")
@click.option("--meta", multiple=True, metavar="KEY=VALUE", help="Typed metadata (repeatable).")
@click.option("--base", metavar="REF", help="Record the commit as an overlay on this base commit.")
@click.option("--base-repo", metavar="PATH", help="Repository holding --base (referenced, not copied).")
@pass_repo
def commit(repo: Repo, paths: tuple[str, ...], message: str, branch: str | None, meta: tuple[str, ...],
           base: str | None, base_repo: str | None) -> None:
    """Record safetensors files or directories as one commit; print its id."""
    if base_repo and not base:
        base = "HEAD"
    oid = repo.commit(list(paths), message=message, branch=branch, metadata=_parse_meta(meta), progress=_progress(),
                      base=base, base_repo=base_repo)
    click.echo(oid)


@main.command()
@click.argument("ref")
@click.option("-o", "--output", "out_dir", required=True, metavar="DIR", help="Directory to write into.")
@click.option("--force", is_flag=True, help="Overwrite existing files that differ.")
@click.option("--only", multiple=True, metavar="PATTERN", help="Only tensors matching this glob (repeatable).")
@click.option("--shard-size", metavar="SIZE",
              help="Write Hugging Face shards of at most SIZE (500MB, 2GiB, bytes) with model.safetensors.index.json.")
@click.option("--merge-lora", is_flag=True, help="Write the base model with the commit's PEFT LoRA adapter merged in.")
@pass_repo
def checkout(repo: Repo, ref: str, out_dir: str, force: bool, only: tuple[str, ...], shard_size: str | None,
             merge_lora: bool) -> None:
    """Write the files of REF into DIR, byte-identical to what was committed."""
    result = repo.checkout(ref, out_dir, force=force, only=list(only) or None, progress=_progress(),
                           shard_size=shard_size, merge_lora=merge_lora)
    click.echo(
        f"wrote {len(result.written)} file(s), {human(result.bytes_written)}"
        + (f"; {len(result.unchanged)} already up to date" if result.unchanged else "")
    )


@main.command(name="import")
@click.argument("path")
@click.option("--recursive", is_flag=True, help="Import every .pth/.pt/.bin/.ckpt file under the folder PATH.")
@click.option("-m", "--message", default=None, help="Commit message (default: the file's name).")
@click.option("--branch", help="Branch to commit to (default: the current branch).")
@click.option("--delete-source", is_flag=True, help="Delete each file once its commit is verified.")
@pass_repo
def import_(repo: Repo, path: str, recursive: bool, message: str | None, branch: str | None, delete_source: bool) -> None:
    """Convert PyTorch pickle checkpoints into commits, safely (torch weights_only, never full pickle)."""
    # Printed as each file lands: if a later file is refused, the commits made so far are known.
    for result in repo.iter_import(path, recursive=recursive, message=message, branch=branch,
                                   delete_source=delete_source):
        click.echo(f"{result.commit}  {result.source}{'  (source deleted)' if result.deleted else ''}")


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
        _json([_entry_json(e.id, e.commit, e.pruned_parents) for e in entries])
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
        doc = {**_entry_json(oid, c), "base": c.base, "provenance": dict(c.provenance), "files": files}
        if c.state is not None:
            doc["state"] = repo.state_document(oid)
        _json(doc)
        return
    click.echo(f"commit {oid}  ({c.branch})\nDate:   {c.time}")
    if c.base is not None:
        click.echo(f"Base:   {c.base['commit']}" + (f" in {c.base['repo']}" if c.base["repo"] else ""))
    if c.message:
        click.echo(f"Message: {c.message}")
    if c.decoded_metadata():
        click.echo(f"Meta:   {_meta_text(c.decoded_metadata())}")
    click.echo("Provenance: " + " ".join(f"{k}={v}" for k, v in c.provenance.items()))
    if c.state is not None:
        click.echo("State:")
        for line in _state_lines(repo.state_document(oid)):
            click.echo(f"  {line}")
    for f in files:
        click.echo(f"\n{f['path']}  [{f['kind']}, {human(f['size'])}{', from base' if f['from_base'] else ''}]")
        for t in f["tensors"]:
            click.echo(f"  {t['name']:<50} {t['dtype']:<8} {str(tuple(t['shape'])):<20}"
                       f"{' (from base)' if t['from_base'] else ''}")


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


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def diff(repo: Repo, a: str, b: str, as_json: bool) -> None:
    """Tensors added, removed, changed and unchanged from A to B."""
    changes = repo.diff(a, b)
    if as_json:
        _json([vars(c) for c in changes])
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
@click.option("--keep-last", type=int, metavar="N", help="Keep the N newest commits of every branch.")
@click.option("--keep-best", type=int, metavar="N", help="Keep the N best commits of every branch by --metric.")
@click.option("--metric", metavar="NAME", help="Metadata metric for --keep-best (lower is better unless --max).")
@click.option("--max", "maximize", is_flag=True, help="Higher --metric is better.")
@click.option("--keep-every", type=int, metavar="K", help="Keep every K-th commit (by step/epoch metadata, else position).")
@click.option("--dry-run", is_flag=True, help="Only say what would be deleted.")
@click.option("--repack", is_flag=True, help="Re-encode the kept objects first (newest commits whole).")
@pass_repo
def gc(repo: Repo, keep_last: int | None, keep_best: int | None, metric: str | None, maximize: bool,
       keep_every: int | None, dry_run: bool, repack: bool) -> None:
    """Delete old commits (with retention options; tags are always kept) and unneeded objects."""
    report = repo.gc(keep_last=keep_last, keep_best=keep_best, metric=metric, maximize=maximize,
                     keep_every=keep_every, dry_run=dry_run, repack=repack)
    verb = "would delete" if dry_run else "deleted"
    for oid in report.pruned_commits:
        click.echo(f"{verb} commit {oid}")
    click.echo(
        f"{verb} {len(report.pruned_commits)} commit(s) and {report.deleted_objects} object(s), "
        f"{'would free' if dry_run else 'freed'} {human(report.freed_bytes)}"
    )


@main.command()
@click.argument("metric")
@click.option("--max", "maximize", is_flag=True, help="Higher is better (default: lower).")
@click.option("--branch", help="Branch to search (default: the current branch).")
@pass_repo
def best(repo: Repo, metric: str, maximize: bool, branch: str | None) -> None:
    """Print the id of the commit with the best METRIC in its metadata."""
    click.echo(repo.best(metric, "max" if maximize else "min", branch))


@main.command()
@pass_repo
def repack(repo: Repo) -> None:
    """Re-encode every kept object with the current settings: newest commits whole, older ones deltas."""
    r = repo.repack()
    if r.upgraded:
        click.echo("upgraded the repository to format version 2")
    click.echo(
        f"repacked {r.objects} object(s): rewrote {r.rewritten}, {r.deltas} now deltas; "
        f"{human(r.bytes_before)} -> {human(r.bytes_after)}"
    )


_SETTINGS = ("chunk_size", "zstd_level", "max_delta_depth")


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
    repo.set_config(replace(repo.config, **{key: value}))
    click.echo(f"{key} = {value}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_repo
def stats(repo: Repo, as_json: bool) -> None:
    """Logical bytes, bytes on disk and their ratio."""
    s = repo.stats()
    doc = {"logical_bytes": s.logical_bytes, "stored_bytes": s.stored_bytes, "ratio": round(s.ratio, 4),
           "commits": s.commits, "objects": s.objects}
    if as_json:
        _json(doc)
        return
    click.echo(f"commits:  {s.commits}\nobjects:  {s.objects}\nlogical:  {human(s.logical_bytes)}")
    click.echo(f"stored:   {human(s.stored_bytes)}\nratio:    {s.ratio:.3f} (stored / logical)")


@main.command()
@click.option("--read-data", is_flag=True, help="Also decompress and re-hash every object.")
@pass_repo
def fsck(repo: Repo, read_data: bool) -> None:
    """Check that every ref, manifest and object is present and sound."""
    problems = repo.fsck(read_data=read_data)
    for problem in problems:
        click.echo(problem)
    if problems:
        _die(f"{len(problems)} problem(s) found", IntegrityError.exit_code)
    click.echo("no problems found" + (" (all data re-hashed)" if read_data else ""))


def run() -> None:
    main(prog_name="ckstore", standalone_mode=True)


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run()

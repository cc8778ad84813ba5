"""Overlays: commits recorded on top of a base commit, in this repository or in another one.

An overlay manifest is complete (every file, every tensor), so checkout needs nothing special;
what makes it cheap is content addressing: a tensor identical to the base has the base's chunk
names and costs nothing, and with ``--base-repo`` those chunks stay in the base repository, whose
store this one reads through (``alternates``, as git's objects/info/alternates). The base
repository lists its overlays in ``dependents`` so its gc keeps what they need.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckstore.errors import CkstoreError, DependentNotFoundError, InvalidInputError, InvalidPathError, RepoNotFoundError
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import BaseRef, Commit, FileEntry
from ckstore.format.positions import position_chunks
from ckstore.format.settings import RELATIVE_LINKS_VERSION
from ckstore.repository.context import RepoContext, open_context, why_unopened
from ckstore.repository.links import (
    ALTERNATES_KEY,
    DEPENDENTS_KEY,
    MAX_BASE_DEPTH,
    Link,
    add_link,
    entry_for,
    read_links,
    read_location,
    read_paths,
    resolve_entry,
    write_location,
    write_paths,
)


def link_base_repo(ctx: RepoContext, base: RepoContext) -> None:
    """Record ``base`` as an alternate of ``ctx`` and ``ctx`` as a dependent of ``base``."""
    here, there = ctx.location, base.location
    if here == there:
        return
    if here in _all_alternates(base):
        raise InvalidInputError(f"{there} already uses {here} as a base: overlays cannot form a cycle")
    recorded = read_location(ctx.backend)
    if recorded is not None and recorded != here and read_paths(ctx.backend, ALTERNATES_KEY):
        relink(ctx)  # moved since it wrote its links: rewrite them from here before adding one
    _record_dependent(base, here, lambda link: False)
    if not any(link.location == there for link in read_links(ctx.backend, ALTERNATES_KEY, here)):
        add_link(ctx.backend, ALTERNATES_KEY, here, there, _entry(ctx, there))
    write_location(ctx.backend, here)
    if all(b.location != there for b in ctx.bases):
        ctx.add_base(base)


def resolve_base(ctx: RepoContext, base: str | None, base_repo: str | os.PathLike[str] | None) -> BaseRef | None:
    """An overlay's base commit; a base in another repository becomes an alternate of this one."""
    if base_repo is None:
        return None if base is None else BaseRef(ctx.graph.resolve(base), None)
    other = open_context(base_repo)
    oid = other.graph.resolve(base or "HEAD")
    link_base_repo(ctx, other)
    # The manifest keeps the absolute path as a record of where the base was; readers locate
    # base repositories through ``alternates`` only (docs/format.md, section 12).
    return BaseRef(oid, other.location)


def _all_alternates(ctx: RepoContext, depth: int = 0) -> set[str]:
    if depth > MAX_BASE_DEPTH:
        return set()
    out = set()
    for link in read_links(ctx.backend, ALTERNATES_KEY, ctx.location):
        out.add(link.location)
        try:
            out |= _all_alternates(open_context(link.location, open_alternates=False), depth + 1)
        except CkstoreError:
            continue
    return out


def merge_files(base: Commit, new: list[FileEntry]) -> list[FileEntry]:
    """The overlay's complete file list: the new files, plus every base file they do not replace."""
    by_path = {f.path: f for f in base.files}
    for f in new:
        by_path[f.path] = f
    merged = sorted(by_path.values(), key=lambda f: f.path)
    paths = {f.path for f in merged}
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in paths:
                raise InvalidPathError(f"overlay file {path!r} lies below the base's file {'/'.join(parts[:i])!r}")
    return merged


def from_base(commit: Commit, base: Commit) -> set[tuple[str, str | None]]:
    """(path, tensor) pairs of ``commit`` that are byte-identical to the base's (None: whole file)."""
    old: dict[tuple[str, str | None], tuple[ObjectId, ...]] = {
        (f.path, None): tuple(c.id for c in f.all_chunks()) for f in base.files
    }
    old.update(
        (pos, tuple(c.id for c in chunks))
        for pos, chunks in position_chunks(base.files, header=False).items()
        if pos[1] is not None
    )
    same: set[tuple[str, str | None]] = set()
    for f in commit.files:
        if old.get((f.path, None)) == tuple(c.id for c in f.all_chunks()):
            same.add((f.path, None))
        for t in f.tensors:
            if old.get((f.path, t.name)) == tuple(c.id for c in t.chunks):
                same.add((f.path, t.name))
    return same


def external_needs(ctx: RepoContext, seen: set[str] | None = None) -> tuple[set[ObjectId], set[str]]:
    """Commits and objects that overlay repositories (dependents, recursively) need from ``ctx``.

    A dependent that cannot be opened stops this with an error rather than counting as needing
    nothing: it may only have moved, and gc would then delete what it reads through ``ctx``.
    """
    here = ctx.location if ctx.path else ""
    seen = seen if seen is not None else {here}
    commits: set[ObjectId] = set()
    chunks: set[str] = set()
    for link in read_links(ctx.backend, DEPENDENTS_KEY, here) if here else []:
        if link.location in seen:
            continue
        seen.add(link.location)
        try:
            dependent = open_context(link.location)
        except CkstoreError as exc:
            raise DependentNotFoundError(
                f"dependent repository {link.location} of {here} cannot be opened ({why_unopened(exc)}); "
                f"gc stopped rather than delete what it may need: {_dependent_advice(here)}"
            ) from None
        # What the dependent's own gc may keep: commits its refs or reflogs reach plus,
        # transitively, the in-repository bases of its overlays ...
        mine: set[str] = set()
        for oid in dependent.graph.with_overlay_bases(dependent.graph.live_commits()):
            commit = dependent.graph.read_commit(oid)
            mine.update(c.id for c in commit.all_chunks())
            if commit.base is not None and commit.base.repo is not None:
                commits.add(commit.base.commit)
        # ... and the delta bases of its chunks, followed through its alternates: a chunk of a
        # plain commit may be a delta of a pruned overlay's chunk, itself a delta of ours.
        chunks |= dependent.store.with_delta_bases(mine)
        more_commits, more_chunks = external_needs(dependent, seen)
        commits |= more_commits
        chunks |= more_chunks
    return commits, chunks


# ---- repairing links after a move ---------------------------------------------------------------


@dataclass
class RelinkedBase:
    location: str  # the base repository, where it is now
    old_entry: str  # this repository's ``alternates`` line for it, before and after
    new_entry: str
    forgotten: list[str]  # stale lines for this repository removed from the base's ``dependents``


@dataclass
class RelinkReport:
    repository: str
    bases: list[RelinkedBase] = field(default_factory=list)
    dependents: list[RelinkReport] = field(default_factory=list)  # relinks run in the named dependents
    pruned: list[str] = field(default_factory=list)  # dependents forgotten: nothing is there any more


def relink(
    ctx: RepoContext,
    bases: Sequence[str | os.PathLike[str]] = (),
    dependents: Sequence[str | os.PathLike[str]] = (),
    prune: bool = False,
) -> RelinkReport:
    """Repair the links between repositories after one of them moved.

    ``bases``: the new locations of base repositories that no longer open from here. Every
    ``alternates`` line is rewritten from this repository's current location, and each base's
    ``dependents`` gets this repository's current entry in place of its old one. ``dependents``:
    do that in the given overlay repositories, with this repository as their base. ``prune``:
    forget dependents where no repository exists any more (deleted overlays).
    """
    here = ctx.location
    report = RelinkReport(here)
    if bases or not (dependents or prune):
        report.bases = _relink_bases(ctx, [open_context(p) for p in bases])
    for path in dependents:
        report.dependents.append(relink(open_context(path), [here]))
    if prune:
        report.pruned = _prune_dependents(ctx)
    return report


def _relink_bases(ctx: RepoContext, new_bases: list[RepoContext]) -> list[RelinkedBase]:
    here = ctx.location
    written_from = read_location(ctx.backend) or here  # where this repository wrote its links
    links = read_links(ctx.backend, ALTERNATES_KEY, here)
    targets: list[RepoContext | None] = []
    for link in links:
        try:
            targets.append(open_context(link.location))
        except CkstoreError:
            targets.append(None)
    needs: tuple[dict[ObjectId, str], set[str]] | None = None
    for new in new_bases:
        there = new.location
        if there == here:
            raise InvalidInputError(f"{here} cannot be its own base repository")
        if any(t is not None and t.location == there for t in targets):
            continue  # linked and reachable: only rewritten below
        broken = [i for i, t in enumerate(targets) if t is None]
        if not broken:
            raise InvalidInputError(
                f"{there} is not a base repository of {here}, and every base repository it names opens"
            )
        needs = needs or _base_needs(ctx)
        _check_is_base(here, new, needs)
        if here in _all_alternates(new):
            raise InvalidInputError(f"{there} already uses {here} as a base: overlays cannot form a cycle")
        targets[_replaced_link(here, new, [(i, links[i]) for i in broken], written_from, needs[0])] = new
    if not links:
        return []
    for link, target in zip(links, targets):
        if target is None:
            raise RepoNotFoundError(
                f"base repository {link.entry} ({link.location}) cannot be opened: give its "
                f"new location too ('ckstore relink PATH...')"
            )
    changes = []
    for link, target in zip(links, targets):
        assert target is not None
        was_at = resolve_entry(link.entry, written_from)  # where the base was when the line was written

        def stale(d: Link, was_at: str = was_at) -> bool:  # this repository's old entry, and nothing there now
            return written_from in (d.location, resolve_entry(d.entry, was_at)) and _gone(d.location)

        forgotten = _record_dependent(target, here, stale)
        changes.append(RelinkedBase(target.location, link.entry, _entry(ctx, target.location), forgotten))
    # Bases' dependents first, then alternates, then location: a rerun after a crash finds the
    # old location still recorded and completes the same rewrite.
    write_paths(ctx.backend, ALTERNATES_KEY, [c.new_entry for c in changes])
    write_location(ctx.backend, here)
    ctx.open_bases()
    return changes


def _base_needs(ctx: RepoContext) -> tuple[dict[ObjectId, str], set[str]]:
    """Base commits this repository's overlays name (with the recorded base repository), and
    every object its kept commits need that it cannot find."""
    named: dict[ObjectId, str] = {}
    chunks: set[str] = set()
    for oid in ctx.graph.with_overlay_bases(ctx.graph.reachable_commits()):
        commit = ctx.graph.read_commit(oid)
        if commit.base is not None and commit.base.repo is not None:
            named[commit.base.commit] = commit.base.repo
        chunks.update(c.id for c in commit.all_chunks())
    wanted = ctx.store.with_delta_bases({c for c in chunks if ctx.store.has(c)}) | chunks | set(named)
    return named, {oid for oid in wanted if not ctx.store.has(oid)}


def _check_is_base(here: str, new: RepoContext, needs: tuple[dict[ObjectId, str], set[str]]) -> None:
    """``new`` holds a base commit this repository's overlays name and cannot find (a commit id
    names one commit; chunks are shared by any repository with the same weights), else, when no
    overlay names one any more, an object this repository misses."""
    named, missing = needs
    evidence = set[str](named) & missing
    what = "missing base commit(s) its overlays name"
    if not evidence:
        evidence, what = (
            (missing, "object(s) it misses") if missing else (set[str](named), "base commit(s) its overlays name")
        )
    if not evidence:
        raise InvalidInputError(
            f"{here} names no base commit and misses no object: nothing shows that "
            f"{new.location} is its base repository"
        )
    if not any(new.store.has(oid) for oid in evidence):
        raise InvalidInputError(
            f"{new.location} is not the base repository of {here}: it holds none of the {len(evidence)} {what}"
        )


def _replaced_link(
    here: str, new: RepoContext, broken: list[tuple[int, Link]], written_from: str, named: dict[ObjectId, str]
) -> int:
    """Which unreachable ``alternates`` line ``new`` replaces: the only one, else the one whose old
    location the overlays' manifests record for a base commit that ``new`` holds."""
    if len(broken) == 1:
        return broken[0][0]
    recorded = {repo for oid, repo in named.items() if new.store.has(oid)}
    matches = [i for i, link in broken if {link.location, resolve_entry(link.entry, written_from)} & recorded]
    if len(matches) != 1:
        raise InvalidInputError(
            f"{len(broken)} base repositories of {here} cannot be opened and nothing tells "
            f"which one {new.location} replaces"
        )
    return matches[0]


def _record_dependent(base: RepoContext, here: str, stale: Callable[[Link], bool]) -> list[str]:
    """Give ``base``'s ``dependents`` the current entry for ``here``, dropping ``stale`` lines;
    the lines dropped (other than an older form of the current entry)."""
    there = base.location
    entry = _entry(base, here)

    def rewrite(links: list[Link]) -> list[str]:  # in place, so an unchanged file is not rewritten
        out = [entry if d.location == here else d.entry for d in links if d.location == here or not stale(d)]
        out = list(dict.fromkeys(out))
        return out if entry in out else [*out, entry]

    current = read_links(base.backend, DEPENDENTS_KEY, there)
    if rewrite(current) == [d.entry for d in current]:
        return []
    with base.backend.exclusive_lock():  # one writer of the file at a time, never during its gc
        current = read_links(base.backend, DEPENDENTS_KEY, there)
        kept = rewrite(current)
        write_paths(base.backend, DEPENDENTS_KEY, kept)
    return [d.entry for d in current if d.location != here and d.entry not in kept]


def _entry(holder: RepoContext, target: str) -> str:
    """How ``holder`` records ``target``. A relative entry needs repository format 3 (an older
    ckstore would resolve it against its working folder): ``holder`` is upgraded when it first
    records one; a version-1 repository, which keeps its old encodings until repack, gets an
    absolute entry instead."""
    entry = entry_for(target, holder.location, allow_relative=holder.config.version >= 2)
    if not os.path.isabs(entry):
        holder.upgrade(RELATIVE_LINKS_VERSION)
    return entry


def _gone(location: str) -> bool:
    """No repository at ``location`` (a damaged one is still there: its links are kept)."""
    try:
        open_context(location, open_alternates=False)
    except RepoNotFoundError:
        return True
    except CkstoreError:
        return False
    return False


def _prune_dependents(ctx: RepoContext) -> list[str]:
    here = ctx.location
    with ctx.backend.exclusive_lock():
        links = read_links(ctx.backend, DEPENDENTS_KEY, here)
        gone = [d for d in links if _gone(d.location)]
        if gone:
            write_paths(ctx.backend, DEPENDENTS_KEY, [d.entry for d in links if d not in gone])
    return [d.location for d in gone]


def _dependent_advice(here: str) -> str:
    repo = shlex.quote(here)
    return (
        f"if it moved, run 'ckstore --repo {repo} relink --dependent NEW_LOCATION'; "
        f"if it was deleted, run 'ckstore --repo {repo} relink --prune'"
    )


def unreachable_bases(ctx: RepoContext) -> list[str]:
    """One line per base repository (or a base's base) that does not open, naming relink."""
    lines = [f"base repository unreachable: {b}" for b in ctx.broken_alternates]
    return list(dict.fromkeys(lines + [line for base in ctx.bases for line in unreachable_bases(base)]))


def link_problems(ctx: RepoContext) -> list[str]:
    """fsck's view of the links: bases (and their bases) that do not open, links one side lacks,
    dependents that do not open; each names the command that repairs it."""
    problems = unreachable_bases(ctx)
    if ctx.path is None:
        return problems
    here = ctx.location
    for base in ctx.bases:
        if here not in {d.location for d in read_links(base.backend, DEPENDENTS_KEY, base.location)}:
            problems.append(
                f"base repository {base.location} does not list {here} among its dependents, so its "
                f"gc may delete what this one needs: run 'ckstore --repo {shlex.quote(here)} relink'"
            )
    for link in read_links(ctx.backend, DEPENDENTS_KEY, here):
        try:
            dependent = open_context(link.location, open_alternates=False)
        except CkstoreError as exc:
            problems.append(
                f"dependent repository unreachable: {link.entry} ({link.location}) cannot be opened: "
                f"{why_unopened(exc)}; {_dependent_advice(here)}"
            )
            continue
        if here not in {b.location for b in read_links(dependent.backend, ALTERNATES_KEY, dependent.location)}:
            problems.append(
                f"dependent repository {dependent.location} does not name {here} in its alternates: "
                f"run 'ckstore --repo {shlex.quote(here)} relink --dependent {shlex.quote(dependent.location)}'"
            )
    return list(dict.fromkeys(problems))

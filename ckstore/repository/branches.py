"""Moving names: create, move and delete branches and tags, switch HEAD's branch, reset it.

Every change goes through the ref store, so it is compare-and-swap under the ref's lock and
recorded in the reflog with what caused it. Deleting the branch HEAD names, or the only branch,
needs ``force``: git refuses the first, and without a branch every commit is one gc away from
deletion (the reflog then keeps them until it expires).
"""

from __future__ import annotations

from ckstore.errors import ForceRequiredError, RefExistsError, RefNotFoundError
from ckstore.format.ids import ObjectId
from ckstore.repository.context import RepoContext
from ckstore.repository.refs import HEADS, TAGS, check_ref_name
from ckstore.repository.writing import writing

_PREFIX = {"branch": HEADS, "tag": TAGS}


def create(
    ctx: RepoContext,
    kind: str,
    name: str,
    rev: str = "HEAD",
    force: bool = False,
) -> tuple[ObjectId | None, ObjectId]:
    """Create branch or tag ``name`` at ``rev``; with ``force``, move it there if it exists.
    Return (the commit it held before, the commit it holds now)."""
    ref = _PREFIX[kind] + check_ref_name(name, f"{kind} name")
    # From resolving the commit to naming it, gc (which holds the lock exclusively) must not run:
    # it could delete the commit in between and leave a ref to nothing (found by the soak).
    with writing(ctx):
        oid = ctx.graph.resolve(rev)
        if force:
            old = ctx.refs.read(ref)
            verb = "reset to" if old else "created from"
            ctx.refs.update(ref, oid, expected=old, reason=f"{kind}: {verb} {rev}")
            return old, oid
        try:
            ctx.refs.update(ref, oid, expected=None, reason=f"{kind}: created from {rev}")
        except RefExistsError:
            if ctx.refs.read(ref) is None:
                raise  # a name conflict ("a" against "a/b"), which -f cannot solve either
            raise RefExistsError(f"{kind} {name!r} already exists; use -f to move it") from None
    return None, oid


def delete(ctx: RepoContext, kind: str, name: str, force: bool = False) -> ObjectId:
    """Delete branch or tag ``name``; return the commit it held. A branch that HEAD names, or the
    only branch, needs ``force``."""
    ref = _PREFIX[kind] + check_ref_name(name, f"{kind} name")
    old = ctx.refs.read(ref)
    if old is None:
        raise RefNotFoundError(f"no {kind} {name!r}")
    if kind == "branch" and not force:
        why = None
        if name == ctx.refs.head_branch():
            why = "it is the current branch (switch to another one first)"
        elif set(ctx.refs.list(HEADS)) == {name}:
            why = "it is the only branch"
        if why:
            raise ForceRequiredError(
                f"refusing to delete branch {name!r}: {why}; --force deletes it anyway (its commits stay"
                f" recoverable through 'ckstore reflog {name}' until gc expires the entries)"
            )
    if not ctx.refs.delete(ref, expected=old, reason=f"{kind}: deleted"):
        raise RefNotFoundError(f"no {kind} {name!r}")
    return old


def switch(ctx: RepoContext, name: str, create_at: str | None = None) -> ObjectId:
    """Make ``name`` the current branch (with ``create_at``: create it there first); return its commit."""
    check_ref_name(name, "branch name")
    oid: ObjectId | None
    if create_at is not None:
        oid = create(ctx, "branch", name, create_at)[1]
    else:
        oid = ctx.refs.read(HEADS + name)
        if oid is None:
            tag = f" ({name!r} is a tag)" if ctx.refs.read(TAGS + name) is not None else ""
            raise RefNotFoundError(f"no branch {name!r}{tag}; 'ckstore switch -c {name} [REF]' creates it")
    ctx.refs.set_head_branch(name, reason="switch")
    return oid


def reset(ctx: RepoContext, rev: str) -> tuple[ObjectId | None, ObjectId]:
    """Move the current branch to ``rev`` (creating it if it has no commits yet); return (the
    commit it held before, the commit it holds now)."""
    branch = ctx.refs.head_branch()
    with writing(ctx):  # resolve and move under the lock gc takes exclusively (see create)
        oid = ctx.graph.resolve(rev)
        old = ctx.refs.read(HEADS + branch)
        ctx.refs.update(HEADS + branch, oid, expected=old, reason=f"reset: moving to {rev}")
    return old, oid

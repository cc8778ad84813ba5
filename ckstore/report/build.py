"""Writing the report file: gathered (data.py), rendered (page.py), then put in place atomically."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ckstore.errors import InvalidInputError, StorageError
from ckstore.report.data import gather
from ckstore.report.page import render
from ckstore.repository.context import RepoContext


def write_report(ctx: RepoContext, refs: Sequence[str], output: Path) -> int:
    """Write the HTML report of the history of ``refs`` to ``output``; return its size in bytes.
    The file appears whole or not at all (a temporary file renamed into place)."""
    if output.is_dir():
        raise InvalidInputError(f"{output} is a directory; give the report's file name, e.g. report.html")
    if not output.parent.is_dir():
        raise InvalidInputError(f"no such directory: {output.parent}")
    data = gather(ctx, refs)
    if not data.commits:
        raise InvalidInputError("nothing to report: the history has no commits")
    text = render(data, refs, ctx.location).encode("utf-8")
    temp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        temp.write_bytes(text)
        os.replace(temp, output)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise StorageError(f"cannot write {output}: {exc.strerror}") from None
    return len(text)

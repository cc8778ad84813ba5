"""How long operations report progress: a bar protocol the caller supplies (the CLI's tqdm), and
the one way operations open, advance and close it.

Operations never import a progress library: they receive a ``ProgressFactory`` (or None, for no
bar) and use ``watching``, so a bar is closed on every path out, an exception included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class ProgressBar(Protocol):
    def update(self, n: int) -> Any: ...

    def close(self) -> Any: ...


# (total, description) -> a bar: how callers (the CLI's tqdm) watch long operations.
ProgressFactory = Callable[[int, str], ProgressBar]


def _ignore(n: int) -> None:
    return None


@contextmanager
def watching(progress: ProgressFactory | None, total: int, description: str) -> Iterator[Callable[[int], Any]]:
    """A bar of ``total`` units opened from ``progress`` (none when it is None); yields the callable
    that advances it by ``n`` (a no-op without a bar) and closes the bar when the block ends."""
    if progress is None:
        yield _ignore
        return
    bar = progress(total, description)
    try:
        yield bar.update
    finally:
        bar.close()

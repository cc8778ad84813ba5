"""Source files read chunk by chunk on the pipeline's workers, into buffers they reuse.

A commit used to read every chunk on the thread that hands chunks out: that one thread copied
the whole state out of the page cache into a fresh 1 MiB object per chunk (a page fault per 4
KiB) while the two workers waited for it a third of the time (py-spy, 271 MB fp32 epoch). A
``Span`` names a chunk's place in its file instead; the worker that stores the chunk reads it
(``read_span``) into a buffer of its own, used again for its next chunk once nothing holds a view
of it (``recycle``: a buffer still viewed is left to its holder, never overwritten).

A file's stored part is dropped from the page cache as the commit goes (``OpenSource.stored``).
The bytes are on disk and in the repository, and nothing in a training loop reads the checkpoint
again; left cached, they were read twice (the save wrote them, the commit read them), which
puts them on the kernel's active list, where they outlive the next epoch's checkpoint: at 10 GB
on 24 GiB, that checkpoint was evicted before its commit read it, and the commit read all
10 GB back from disk (docs/benchmarks.md, the 10 GB runs).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ckstore.backend.fsio import DropBehind, drop_cached
from ckstore.errors import InvalidInputError, StorageError


class OpenSource:
    """One source file, open while workers read its chunks; closed, after a check that it did
    not grow meanwhile, once the last of them is stored (``finished``)."""

    def __init__(self, path: Path, size: int) -> None:
        self.name = str(path)
        self.size = size
        self.pending = 0  # spans handed out and not yet finished
        self.listed = False  # every span of the file has been handed out
        self._lock = threading.Lock()  # ``stored`` is called on the pipeline's workers
        self._stored = DropBehind()
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            # Gone since the inputs were listed: the same mistake as naming a missing path (exit 5).
            raise InvalidInputError(f"{path} disappeared while being committed (no such file)") from None
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror}") from None

    def span(self, offset: int, length: int) -> Span:
        self.pending += 1
        return Span(self, offset, length)

    def stored(self, span: Span) -> None:
        """``span``'s chunk is stored: drop the stored part of the file from the page cache in
        steps (clean pages; the advice starts writeback of dirty ones)."""
        with self._lock:
            for offset, length in self._stored.add(span.offset, span.length):
                self._advise_drop(offset, length)

    def _advise_drop(self, offset: int, length: int) -> None:
        if self.fd >= 0:
            drop_cached(self.fd, offset, length)

    def finished(self) -> None:
        """One span stored; the last one closes the file."""
        self.pending -= 1
        if self.listed and not self.pending:
            self.close(check_end=True)

    def all_listed(self) -> None:
        self.listed = True
        if not self.pending:
            self.close(check_end=True)

    def close(self, check_end: bool = False) -> None:
        if self.fd < 0:
            return
        if check_end:
            self._advise_drop(0, 0)  # the whole file, every span stored
        fd, self.fd = self.fd, -1
        try:
            if check_end and os.pread(fd, 1, self.size):
                raise InvalidInputError(f"{self.name} changed while being committed (it got longer)")
        except OSError as exc:
            raise StorageError(f"cannot read {self.name}: {exc.strerror}") from None
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Span:
    """``length`` bytes of a source file at ``offset``: a chunk before it is read."""

    source: OpenSource
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length


_buffers = threading.local()


def read_span(span: Span) -> memoryview:
    """The span's bytes, in this thread's buffer: valid until ``recycle``."""
    buffer: bytearray | None = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < span.length:
        buffer = _buffers.buffer = bytearray(span.length)
    with memoryview(buffer) as whole:
        view = whole[: span.length]
    done = 0
    try:
        while done < span.length:
            with view[done:] as rest:
                n = os.preadv(span.source.fd, [rest], span.offset + done)
            if not n:
                raise InvalidInputError(f"{span.source.name} changed while being committed (it got shorter)")
            done += n
    except OSError as exc:
        view.release()
        raise StorageError(f"cannot read {span.source.name}: {exc.strerror}") from None
    except BaseException:
        view.release()
        raise
    return view


def recycle(view: memoryview) -> None:
    """Give a ``read_span`` view back. Its buffer serves the thread's next read only if nothing
    else views it any more (a numpy array, a slice kept by a store): resizing a bytearray that is
    still viewed fails, which is the test; a buffer that fails it is left to whoever holds it."""
    view.release()
    buffer: bytearray | None = getattr(_buffers, "buffer", None)
    if buffer is None:
        return
    try:
        buffer.append(0)
        buffer.pop()
    except BufferError:
        _buffers.buffer = None

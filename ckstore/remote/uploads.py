"""Packs uploaded while they are being made: each verified object goes out at once.

A pack used to be assembled whole (read and verify 32 MiB of objects, join them, hash the
result to name it) before its upload could start, so every push began with a pause that no
transfer overlapped, and paid for a 32 MiB copy per pack. Packs are named at random before their
first byte (docs/format.md 15.1), so here a pack's upload starts with its header and each object
follows as soon as the pusher has verified it; the table and trailer close the stream, then the
index is written (pack, then index: ``RemoteRepo.upload_pack``).

Between the thread that verifies objects and each upload runs a small bounded queue (a
``_Feed``): the pusher blocks when an upload falls behind, so memory stays a few objects per
pack in flight, and at most ``workers`` packs are in flight. If anything fails — an object that
does not verify, an upload the server refuses — every unfinished upload is aborted by raising in
its stream, which stores nothing (``Transport.put_parts``); packs whose uploads completed keep
their indexes and count as sent on the next try, as after any interrupted push.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import cast

from ckstore.format.pack import DEFAULT_TARGET_SIZE, PackIndex
from ckstore.format.pack_build import PackBuilder
from ckstore.remote.layout import RemoteRepo

# Parts queued for one pack ahead of its upload (memory: about this many stored objects).
FEED_AHEAD = 8
_END = object()


class _Stopped(Exception):
    """The upload that reads this feed has ended (it failed: its own error says why)."""


class _Feed:
    """The bytes of one pack on their way from the pusher's thread to its upload's."""

    def __init__(self) -> None:
        self._queue: queue.Queue[object] = queue.Queue(FEED_AHEAD)
        self.stopped = threading.Event()  # the upload no longer reads

    def send(self, item: object) -> None:
        while not self.stopped.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue
        raise _Stopped

    def parts(self) -> Iterator[bytes | memoryview]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield cast(bytes | memoryview, item)  # the queue holds parts, one error, or the end


@dataclass
class _Pack:
    builder: PackBuilder
    feed: _Feed = field(default_factory=_Feed)
    index: PackIndex | None = None
    upload: Future[None] | None = None


class PackUploads:
    """Add verified (id, stored bytes, their BLAKE3) one by one; packs of about ``target_size``
    bytes upload as they fill. Use as a context manager: leaving normally finishes every
    upload (``sent`` then lists the indexes of the packs written), leaving with an exception
    aborts the unfinished ones."""

    def __init__(self, remote: RemoteRepo, target_size: int = DEFAULT_TARGET_SIZE, workers: int = 4) -> None:
        self.remote = remote
        self.target_size = target_size
        self.workers = workers
        self.sent: list[PackIndex] = []
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="upload")
        self._open: deque[_Pack] = deque()  # in flight, oldest first; the last may be filling
        self._filling: _Pack | None = None

    def __enter__(self) -> PackUploads:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if exc is None:
                self._close_filling()
                while self._open:
                    self._finish_oldest()
            else:
                self._abort(exc)
        finally:
            self._pool.shutdown(wait=True)

    def add(self, oid: str, stored: bytes | memoryview, digest: bytes) -> None:
        if self._filling is not None and not self._filling.builder.fits(len(stored)):
            self._close_filling()
        if self._filling is None:
            self._start()
        pack = self._filling
        assert pack is not None
        pack.builder.add(oid, stored, digest)
        self._send(pack, stored)

    def cut(self) -> None:
        """End the pack being filled: what is added next goes into a new one (objects that will
        live for different spans of time belong in different packs, repack.py)."""
        if self._filling is not None:
            self._close_filling()

    def _start(self) -> None:
        while len(self._open) >= self.workers:
            self._finish_oldest()
        pack = _Pack(PackBuilder(self.target_size))
        pack.upload = self._pool.submit(self._upload, pack)
        self._open.append(pack)
        self._filling = pack
        self._send(pack, pack.builder.header)

    def _upload(self, pack: _Pack) -> None:
        try:
            self.remote.upload_pack(pack.builder.pack_id, pack.feed.parts(), lambda: self._index_of(pack))
        finally:
            pack.feed.stopped.set()

    @staticmethod
    def _index_of(pack: _Pack) -> bytes:
        assert pack.index is not None  # the stream ended only after close() made it
        return pack.index.to_bytes()

    def _send(self, pack: _Pack, item: object) -> None:
        try:
            pack.feed.send(item)
        except _Stopped:
            assert pack.upload is not None
            pack.upload.result()  # raises the upload's own error
            raise AssertionError("an upload stopped reading before its pack ended") from None

    def _close_filling(self) -> None:
        pack, self._filling = self._filling, None
        if pack is None:
            return
        tail, pack.index = pack.builder.close()
        self._send(pack, tail)
        self._send(pack, _END)

    def _finish_oldest(self) -> None:
        pack = self._open.popleft()
        assert pack.upload is not None and pack.index is not None
        pack.upload.result()
        self.sent.append(pack.index)

    def _abort(self, exc: BaseException) -> None:
        reason = exc if isinstance(exc, Exception) else RuntimeError("push interrupted")
        for pack in self._open:
            try:
                pack.feed.send(reason)
            except _Stopped:
                pass
        for pack in self._open:
            assert pack.upload is not None
            try:
                pack.upload.result()
            except BaseException:  # noqa: BLE001 - the first error is the one that propagates
                pass
            else:
                if pack.index is not None:
                    self.sent.append(pack.index)
        self._open.clear()
        self._filling = None

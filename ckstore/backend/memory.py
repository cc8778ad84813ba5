"""An in-memory backend: fast tests, and the reference for the conformance suite."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ckstore.backend.base import Backend, check_key, check_prefix
from ckstore.errors import LockedError


class MemoryBackend(Backend):
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._mutex = threading.Lock()
        self._readers = 0
        self._writer = False
        self._cond = threading.Condition(self._mutex)

    def get(self, key: str) -> bytes:
        with self._mutex:
            return self._data[check_key(key)]

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._mutex:
            if check_key(key) in self._data:
                return False
            self._data[key] = bytes(data)
            return True

    def replace(self, key: str, data: bytes) -> None:
        with self._mutex:
            self._data[check_key(key)] = bytes(data)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        return self.put_if_absent(key, data)

    def delete(self, key: str) -> bool:
        with self._mutex:
            return self._data.pop(check_key(key), None) is not None

    def size(self, key: str) -> int | None:
        with self._mutex:
            value = self._data.get(check_key(key))
            return None if value is None else len(value)

    def list(self, prefix: str) -> Iterator[str]:
        prefix = check_prefix(prefix)  # a folder: "refs/heads" must not match "refs/headsx/…"
        with self._mutex:
            keys = sorted(k for k in self._data if k.startswith(prefix))
        yield from keys

    @contextmanager
    def repo_lock(self, exclusive: bool, timeout: float) -> Iterator[None]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._writer or (exclusive and self._readers):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LockedError("repository is locked by another operation; try again later")
                self._cond.wait(remaining)
            if exclusive:
                self._writer = True
            else:
                self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                if exclusive:
                    self._writer = False
                else:
                    self._readers -= 1
                self._cond.notify_all()

    def clean_temporary(self) -> int:
        return 0

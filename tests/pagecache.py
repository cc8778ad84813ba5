"""What the page cache holds of a file (mincore), for tests of the page-cache advice that
commits and compactions give (write/spans.py, backend/fsio.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import pytest

needs_fadvise = pytest.mark.skipif(
    sys.platform != "linux" or not hasattr(os, "POSIX_FADV_DONTNEED"), reason="Linux only"
)


def cached_bytes(path: Path) -> int:
    return cached_bytes_of(path, 0, path.stat().st_size)


def cached_clean(path: Path) -> None:
    """Bring ``path`` into the page cache as clean pages (those the advice drops), or skip where
    the file system keeps no such pages (tmpfs answers differently)."""
    with open(path, "rb") as f:
        f.read()
        os.fsync(f.fileno())
    if cached_bytes(path) < path.stat().st_size // 2:
        pytest.skip("this file system does not keep the file in the page cache")


def cached_bytes_of(path: Path, offset: int, length: int) -> int:
    """Bytes of ``path``'s pages from ``offset`` for ``length`` that the page cache holds:
    mincore over a private mapping of the file (unlike a probing read, it starts no readahead;
    pages never written report the file's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        vector = (ctypes.c_ubyte * ((len(mapped) + page - 1) // page))()
        window = (ctypes.c_char * len(mapped)).from_buffer(mapped)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(window)), ctypes.c_size_t(len(mapped)), vector):
                pytest.skip(f"mincore: {os.strerror(ctypes.get_errno())}")
        finally:
            del window  # the mapping closes only once nothing exports it
        first, last = offset // page, (offset + length + page - 1) // page
        return sum(page for resident in vector[first:last] if resident & 1)


def evict(path: Path) -> None:
    """Drop ``path``'s clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert cached_bytes(path) < path.stat().st_size // 8

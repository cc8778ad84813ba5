"""The machine's own limits, measured on the benchmark's data (used by scripts/bench.py).

A commit must hash every byte, compress every new chunk and write what it stores durably; each
of these has a ceiling on this machine whatever the store does around it. Measured here on the
same checkpoint bytes, with the same libraries ckstore uses:

- blake3 over whole tensors with the library's own multithreading (``max_threads=AUTO``);
- zstd level 1 on 1 MiB chunks, one chunk per core at a time (ckstore's chunking and pool);
- sequential writes of 8 MiB blocks to a new file, then fsync (a durable write, what a commit
  and ``save_file`` + fsync both end with).

Each rate is the median of ``reps`` passes. Rates are MB/s (10^6 bytes) of input.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import zstandard

CHUNK = 1 << 20
BLOCK = 8 << 20


def _rate(nbytes: int, fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e6


def read_files(paths: list[Path]) -> list[bytes]:
    return [p.read_bytes() for p in paths]


def blake3_rate(data: list[bytes], reps: int) -> float:
    def run() -> None:
        for blob in data:
            blake3.blake3(blob, max_threads=blake3.blake3.AUTO).digest()

    return _rate(sum(map(len, data)), run, reps)


def zstd_rate(data: list[bytes], reps: int, level: int = 1) -> tuple[float, float]:
    """(MB/s on every core, compressed fraction) for independent 1 MiB chunks."""
    views = [memoryview(blob)[i : i + CHUNK] for blob in data for i in range(0, len(blob), CHUNK)]
    local = threading_local_compressor(level)
    sizes: list[int] = []

    def run() -> None:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            sizes[:] = list(pool.map(lambda v: len(local().compress(v)), views))

    rate = _rate(sum(map(len, data)), run, reps)
    return rate, sum(sizes) / sum(map(len, data))


def threading_local_compressor(level: int) -> Callable[[], zstandard.ZstdCompressor]:
    """A compressor per thread (a ZstdCompressor must not be shared between threads)."""
    import threading

    store = threading.local()

    def get() -> zstandard.ZstdCompressor:
        if not hasattr(store, "c"):
            store.c = zstandard.ZstdCompressor(level=level)
        return store.c

    return get


def write_rate(folder: Path, nbytes: int, reps: int) -> float:
    """fsync'd sequential write of ``nbytes`` (incompressible bytes, so no filesystem trick helps)."""
    block = os.urandom(BLOCK)
    target = folder / "write-rate.bin"

    def run() -> None:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[: min(BLOCK, left)])
            os.fsync(fd)
        finally:
            os.close(fd)
        target.unlink()

    return _rate(nbytes, run, reps)


def measure(sample: list[Path], folder: Path, reps: int) -> dict[str, float]:
    """Every limit on the files in ``sample`` (read once into memory) and a folder to write in."""
    data = read_files(sample)
    size = sum(map(len, data))
    zstd, fraction = zstd_rate(data, reps)
    return {
        "bytes": size,
        "blake3": blake3_rate(data, reps),
        "zstd1": zstd,
        "zstd1_fraction": fraction,
        "write": write_rate(folder, max(size, 256 << 20), reps),
    }

"""fsio.EarlyFlush: background flushes while a long write goes on, errors never lost; fsio.DropBehind:
which parts of a file leave the page cache; fsio.PositionalWriter: many threads writing one file."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.backend.fsio import DropBehind, EarlyFlush, PositionalWriter


def test_flushes_once_per_threshold_and_one_at_a_time() -> None:
    calls: list[int] = []
    gate = threading.Event()

    def flush() -> None:
        calls.append(1)
        gate.wait(5)

    early = EarlyFlush(flush, every=100)
    early.wrote(99)
    assert calls == []  # below the threshold: nothing yet
    early.wrote(1)
    early.wrote(500)  # a flush is still running: no second one starts
    gate.set()
    early.finish()
    assert calls == [1]


def test_a_failed_early_flush_is_raised_by_finish() -> None:
    def flush() -> None:
        raise OSError(errno.EIO, "Input/output error")

    early = EarlyFlush(flush, every=10)
    early.wrote(10)
    with pytest.raises(OSError) as info:
        early.finish()
    assert info.value.errno == errno.EIO
    early.wrote(100)  # after a failure no more flushes start, and finish stays quiet if asked
    early.finish(quiet=True)


def test_a_filesystem_that_cannot_flush_stops_early_flushes() -> None:
    calls: list[int] = []

    def flush() -> bool:
        calls.append(1)
        return False

    early = EarlyFlush(flush, every=10)
    early.wrote(10)
    deadline = time.monotonic() + 5
    while early.flushing() and time.monotonic() < deadline:
        time.sleep(0.01)
    early.wrote(10)  # the first flush said "cannot": no second one
    early.finish()
    assert calls == [1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 255), st.integers(1, 24)), min_size=1, max_size=40), st.integers(1, 6))
def test_drop_behind_advises_every_whole_aligned_block_added_and_nothing_else(
    ranges: list[tuple[int, int]], step_blocks: int
) -> None:
    """Ranges added in any order, unaligned: every advice is aligned and lies inside what was
    added; by the end every aligned block inside it was advised (the kernel drops a folio only
    when the advice covers all of it, so an advice past what was added would drop pages a reader
    still wants)."""
    align = 16
    behind = DropBehind(step=step_blocks * align, align=align)
    added = bytearray(256 * 3 + 24 * 3)
    advised = bytearray(len(added))
    for start, length in ranges:
        offset, size = start * 3, length * 3  # never aligned to ``align`` as a rule
        added[offset : offset + size] = b"\1" * size
        for adv_offset, adv_length in behind.add(offset, size):
            assert adv_offset % align == 0 and adv_length % align == 0 and adv_length > 0
            assert all(added[adv_offset : adv_offset + adv_length])
            advised[adv_offset : adv_offset + adv_length] = b"\1" * adv_length
    for adv_offset, adv_length in behind.pending():
        assert all(added[adv_offset : adv_offset + adv_length])
        advised[adv_offset : adv_offset + adv_length] = b"\1" * adv_length
    for block in range(0, len(added) - align + 1, align):
        if all(added[block : block + align]):
            assert all(advised[block : block + align]), block


def test_drop_behind_waits_for_a_step_between_advices() -> None:
    behind = DropBehind(step=64, align=16)
    assert behind.add(0, 40) == []  # below a step: the calls stay few
    assert behind.add(40, 40) == [(0, 80)]
    assert behind.add(80, 8) == []
    assert behind.pending() == []  # 88 rounds down to 80: advised already


def test_threads_writing_one_file_at_their_offsets_leave_every_byte_in_place(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(7)
    pieces, offset = [], 0
    for _ in range(300):
        data = rng.randbytes(rng.randrange(1, 5000))
        pieces.append((offset, data))
        offset += len(data)
    rng.shuffle(pieces)
    real_pwrite = os.pwrite
    # Short writes, as a kernel may return them: each call writes at most 999 bytes.
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: real_pwrite(fd, memoryview(data)[:999], at))
    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        writer = PositionalWriter(fd)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda piece: writer.write_at(piece[1], piece[0]), pieces))
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(data for _, data in sorted(pieces))

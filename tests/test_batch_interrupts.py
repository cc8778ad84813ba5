"""A Ctrl-C at any moment of a local batch (backend/local_batch.py, the commit's durability
batch) never leaves a temporary file, and what it leaves stored is whole (an interrupted commit
writes no manifest: gc removes objects nothing names).

The signal is real: a tracer sends SIGINT to this process as the batch code enters its n-th
function call, for every n, and Python raises KeyboardInterrupt where it next checks for signals,
as a function starts (or later, where the code holds signals back around its bookkeeping).
Function entries, not every line: between a lock's ``__enter__`` and its ``with`` block no check
happens for a real signal, but a line tracer's exception lands there (and leaks the lock). Found by CI: an interrupted
``ckstore commit`` left its pack's temporary file when the signal landed as the batch's flush
began."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import blake3
import pytest

from ckstore.codecs.objects import Kind, encode
from ckstore.format.ids import object_key
from ckstore.repo import Repo

from helpers import leftover_temp_files

BATCH_CODE = ("backend/local_batch.py", "backend/local_packs.py")


def _objects(seed: int) -> dict[str, bytes]:
    """Three small chunks (packed when the batch packs) and one of 200 KB, stored raw."""
    raws = [os.urandom(100) + bytes([seed, i]) for i in range(3)] + [os.urandom(200_000) + bytes([seed])]
    return {object_key(blake3.blake3(raw).hexdigest()): encode(raw, Kind.CHUNK, -1) for raw in raws}


def _run_batch(root: Path, objects: dict[str, bytes], many: bool, interrupt_at: int | None) -> tuple[int, bool]:
    """Write ``objects`` in one batch; send SIGINT as the batch code makes its ``interrupt_at``-th
    call. Returns the calls counted and whether the batch was interrupted."""
    backend = Repo(root).backend
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "call" and frame.f_code.co_filename.endswith(BATCH_CODE):
            count += 1
            if count == interrupt_at:
                os.kill(os.getpid(), signal.SIGINT)
        return None

    armed = True

    def on_sigint(signum: int, frame: object) -> None:
        if armed:  # a signal the batch held back until after this test's check is dropped
            raise KeyboardInterrupt

    interrupted = False
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        sys.settrace(tracer)
        try:
            with backend.batch(expected_objects=64 if many else 1) as staged:
                for key, data in objects.items():
                    staged.put_new(key, data)
        finally:
            sys.settrace(None)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        armed = False
        signal.signal(signal.SIGINT, previous)
    return count, interrupted


@pytest.mark.parametrize("many", [False, True], ids=["loose", "packed"])
def test_a_ctrl_c_anywhere_in_a_batch_leaves_no_temporary_file_and_only_whole_objects(tmp_path: Path, many: bool) -> None:
    calls, _ = _run_batch(Path(Repo.init(tmp_path / "count").path or ""), _objects(0), many, None)
    assert calls > 20
    interrupted_runs = 0
    for n in range(1, calls + 1):
        root = tmp_path / f"r{n}"
        Repo.init(root)
        objects = _objects(n)
        _, interrupted = _run_batch(root, objects, many, n)
        interrupted_runs += interrupted
        assert leftover_temp_files(root) == [], f"SIGINT at call {n} of {calls}"
        backend = Repo(root).backend
        stored = [backend.exists(key) for key in objects]
        if not interrupted:
            assert all(stored), f"SIGINT at call {n} of {calls}: batch completed without its objects"
        for key in objects:  # what is there is whole
            if backend.exists(key):
                assert backend.get(key) == objects[key]
    assert interrupted_runs > calls // 2  # the signals did land (most calls come before the end)

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
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import blake3
import pytest

from ckstore.codecs.objects import Kind, encode
from ckstore.format.ids import object_key
from ckstore.repo import Repo
from tests.helpers import leftover_temp_files

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
def test_a_ctrl_c_anywhere_in_a_batch_leaves_no_temporary_file_and_only_whole_objects(
    tmp_path: Path, many: bool
) -> None:
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


class _InterruptingBar:
    """A progress bar whose third update is a Ctrl-C: it lands in the commit's loop over stored
    chunks, between two of them, while the workers are still storing the next ones."""

    def __init__(self, interrupted: threading.Event) -> None:
        self.left = 3
        self.interrupted = interrupted

    def update(self, n: int) -> None:
        self.left -= 1
        if not self.left:
            self.interrupted.set()
            raise KeyboardInterrupt

    def close(self) -> None:
        pass


def test_a_ctrl_c_between_chunks_waits_for_the_workers_before_the_batch_is_dropped(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C between two stored chunks, while workers are still storing later ones (slowly,
    each finding its pack full and starting another): nothing is left, no commit, fsck clean."""
    import time

    import torch
    from safetensors.torch import save_file

    from ckstore.backend import local_packs
    from ckstore.backend.local import LocalBackend

    interrupted = threading.Event()
    add = local_packs.PackWriter.add
    full: set[int] = set()

    def late_add(self: local_packs.PackWriter, oid: str, data: bytes | memoryview) -> bool | None:
        # Once per worker thread: keyed by the pack, as before, every new pack was "full" too, and
        # the workers started packs until an id happened to be reused (a CI run took 81 minutes).
        if interrupted.is_set() and threading.get_ident() not in full:
            time.sleep(0.2)  # still storing after the main thread was interrupted
            full.add(threading.get_ident())
            return None  # full: the caller starts another pack
        return add(self, oid, data)

    monkeypatch.setattr(LocalBackend, "pack_min_bytes", 0)
    monkeypatch.setattr(local_packs.PackWriter, "add", late_add)
    src = tmp_path / "ckpt"
    src.mkdir()
    save_file({"w": torch.randn(1 << 20)}, str(src / "model.safetensors"))  # 4 MiB: 64 chunks
    repo = Repo.init(tmp_path / "repo", chunk_size=1 << 16)
    with pytest.raises(KeyboardInterrupt):
        repo.commit(src, progress=lambda total, what: _InterruptingBar(interrupted))
    time.sleep(0.5)  # a worker left running has started its pack by now
    assert leftover_temp_files(repo.path) == []  # type: ignore[arg-type]
    assert repo.branches() == {}
    assert repo.fsck() == []


def test_a_put_into_a_discarded_batch_writes_nothing(tmp_path: Path) -> None:
    """A worker still running when its batch was discarded (the commit was interrupted) gets an
    error and creates no file: before, one that found no pack started a new one, whose
    temporary file nothing removed (a cause of test_cli's Ctrl-C test leaving a pack's .tmp)."""
    from ckstore.backend.local import LocalBackend
    from ckstore.errors import StorageError

    backend = LocalBackend(tmp_path / "root")
    objects = _objects(0)
    keys = list(objects)
    with pytest.raises(KeyboardInterrupt):
        with backend.batch(expected_bytes=1 << 30) as staged:  # packs
            staged.put_new(keys[0], objects[keys[0]])
            raise KeyboardInterrupt
    for key in keys[1:]:  # the late puts: a small object (packed) and the large one (loose)
        with pytest.raises(StorageError):
            staged.put_new(key, objects[key])
    assert leftover_temp_files(tmp_path / "root") == []
    assert not any(backend.exists(key) for key in keys)

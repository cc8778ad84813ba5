"""Per-epoch times and stored bytes of one fine-tune run, ckstore beside its baselines (for bench.py).

For one run's four epoch checkpoints (model + AdamW state as safetensors files) this measures, in
one process and interleaved within each repetition so that a slow moment of a shared machine
hits both sides alike:

- the baseline: safetensors ``save_file`` of the epoch's tensors (already in memory) + fsync of
  both files and their folder; ``load_file`` of both files + reading every byte;
- the I/O floor of writing an epoch: the two files' exact bytes, already in memory, written with
  one ``write`` each + fsync of both and their folder (what save_file costs without serializing;
  a checkout writes these very bytes);
- ``Repo.commit`` of the epoch's files, in each naming layout (one name for every epoch, a file
  name per epoch), each layout in a fresh repository, until it returns (the commit is durable);
  then the compaction that follows it (``Repo.wait``, timed apart: it runs while training goes
  on); then checkout of the newest commit into an empty folder;
- ``Repo.commit_state`` of the same tensors as an in-memory state (synchronous), then
  ``load_state`` of the newest + reading every byte;
- ``commit_state(..., background=True)``: the time until it returns (what the training loop is
  blocked for) and until ``handle.result()`` returns (the commit recorded), each epoch's commit
  finishing before the next starts;
- ``torch.save`` + fsync, and single-process ``torch.distributed.checkpoint`` ``save`` and
  ``async_save`` (FileSystemWriter, files synced) of the newest epoch's state.

An epoch's figure is the mean over the epochs that have a parent (2-4: the first commit has
nothing to delta against); each reported figure is the median of that over the repetitions.
Stored bytes are those of the first repetition (they do not depend on timing).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ckstore import Repo
from ckstore.backend.fsio import fsync_path

FILES = ("model.safetensors", "optimizer.safetensors")
# How a training script names what it saves each epoch; the path committed for file f of epoch n.
# (A folder per epoch, epoch_N/model.safetensors, pairs tensors by the same rule as a file name per
# epoch — the path is new, the tensor name is not — so it is not timed separately.)
LAYOUTS: dict[str, Callable[[int, str], str]] = {
    "one name": lambda n, f: f,
    "epoch names": lambda n, f: f.replace(".safetensors", f"_epoch_{n}.safetensors"),
}


def timed(fn: Callable[[], object], settle: bool = True) -> float:
    # Every timed operation starts with nothing left dirty in the page cache. In training, minutes
    # of compute separate two checkpoints, and the kernel writes back what the previous one (and
    # the compaction after it) left meanwhile; back to back, the next operation's own flush would
    # pay for it instead, whichever column that is.
    if settle:
        os.sync()
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def touch(tree: Any) -> int:
    """Read every byte of every tensor (a lazy or mapped load pays for its data here)."""
    if isinstance(tree, torch.Tensor):
        return int(tree.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) if tree.numel() else 0
    if isinstance(tree, dict):
        return sum(touch(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(touch(v) for v in tree)
    return 0


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def stage(dirs: list[Path], root: Path, name: Callable[[int, str], str]) -> list[Path]:
    """For each epoch a folder holding its files under the layout's names (hard links: no copy)."""
    shutil.rmtree(root, ignore_errors=True)
    out = []
    for n, d in enumerate(dirs, start=1):
        folder = root / f"commit{n}"
        for f in FILES:
            target = folder / name(n, f)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(d / f, target)
            except OSError:  # another filesystem
                shutil.copyfile(d / f, target)
        out.append(folder)
    return out


class EpochBench:
    """The measurements of one run; ``repeat`` runs one repetition of all of them."""

    def __init__(self, dirs: list[Path], work: Path) -> None:
        self.dirs = dirs
        self.work = work
        self.states = [{"model": load_file(str(d / FILES[0])), "optimizer": load_file(str(d / FILES[1]))} for d in dirs]
        self.file_bytes = [[(d / f).read_bytes() for f in FILES] for d in dirs]
        self.raw = sum((d / f).stat().st_size for d in dirs for f in FILES)
        self.staged = {
            layout: stage(dirs, work / "staged" / layout.replace(" ", "_"), name) for layout, name in LAYOUTS.items()
        }
        self.samples: dict[str, list[float]] = {}
        self.stored: dict[str, int] = {}

    def _add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def _fresh(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def repeat(self) -> None:
        first = not self.samples
        self._baseline()
        for layout, folders in self.staged.items():
            self._files(layout, folders, first)
        self._state(first)
        self._background()
        self._torch_formats(first)
        for name in ("repo", "out", "st"):
            shutil.rmtree(self.work / name, ignore_errors=True)

    def _baseline(self) -> None:
        times, floor = [], []
        for n, (state, blobs) in enumerate(zip(self.states, self.file_bytes), start=1):
            folder = self._fresh("st") / f"epoch{n}"
            folder.mkdir(parents=True)

            def save() -> None:
                for f, part in zip(FILES, ("model", "optimizer")):
                    save_file(state[part], str(folder / f))
                    fsync_path(folder / f)
                fsync_path(folder)

            def write() -> None:
                for f, blob in zip(FILES, blobs):
                    with open(folder / f"written_{f}", "wb") as out:
                        out.write(blob)
                        out.flush()
                        os.fsync(out.fileno())
                fsync_path(folder)

            times.append(timed(save))
            floor.append(timed(write))
        self._add("save", statistics.mean(times[1:]))
        self._add("write", statistics.mean(floor[1:]))
        last = self.dirs[-1]
        self._add("load", timed(lambda: touch([load_file(str(last / f)) for f in FILES])))

    def _files(self, layout: str, folders: list[Path], first: bool) -> None:
        repo = Repo.init(self._fresh("repo"))
        times, compaction = [], []
        for f in folders:
            times.append(timed(lambda f=f: repo.commit(str(f), message=f.name)))
            compaction.append(timed(repo.wait, settle=False))  # training would run meanwhile (compact.py)
        self._add(f"commit1 {layout}", times[0])
        self._add(f"commit {layout}", statistics.mean(times[1:]))
        self._add(f"compaction {layout}", statistics.mean(compaction[1:]))
        out = self._fresh("out")  # deleting the previous checkout is not part of this one
        self._add(f"checkout {layout}", timed(lambda: repo.checkout("HEAD", out)))
        if first:
            self.stored[layout] = repo.stats().stored_bytes

    def _state(self, first: bool) -> None:
        repo = Repo.init(self._fresh("repo"))
        times = []
        for n, s in enumerate(self.states, start=1):
            times.append(timed(lambda s=s, n=n: repo.commit_state(s, metadata={"epoch": n})))
            repo.wait()  # the compaction after the commit: off the loop's path, not timed here
        self._add("commit_state1", times[0])
        self._add("commit_state", statistics.mean(times[1:]))
        self._add("load_state", timed(lambda: touch(repo.load_state("HEAD"))))
        if first:
            self.stored["state"] = repo.stats().stored_bytes

    def _background(self) -> None:
        repo = Repo.init(self._fresh("repo"))
        blocked, done = [], []
        for n, state in enumerate(self.states, start=1):
            gc.collect()
            started = time.perf_counter()
            handle = repo.commit_state(state, metadata={"epoch": n}, background=True)
            blocked.append(time.perf_counter() - started)
            handle.result()
            done.append(time.perf_counter() - started)
            repo.wait()
        self._add("blocked", statistics.mean(blocked[1:]))
        self._add("background", statistics.mean(done[1:]))

    def _torch_formats(self, first: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        state = self.states[-1]
        folder = self._fresh("st")
        folder.mkdir()
        target = folder / "state.pt"

        def torch_save() -> None:
            torch.save(state, target)
            fsync_path(target)
            fsync_path(folder)

        self._add("torch.save", timed(torch_save))
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            self._add("dcp", timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(folder / "dcp"))))
            gc.collect()
            started = time.perf_counter()
            future = dcp.async_save(state, storage_writer=FileSystemWriter(folder / "dcp_async"))
            self._add("dcp_async blocked", time.perf_counter() - started)
            future.result()
            self._add("dcp_async", time.perf_counter() - started)
        if first:
            self.stored["torch.save"] = target.stat().st_size * len(self.dirs)
            self.stored["dcp"] = folder_size(folder / "dcp") * len(self.dirs)

    def medians(self) -> dict[str, float]:
        return {key: statistics.median(values) for key, values in self.samples.items()}


def measure(dirs: list[Path], work: Path, reps: int) -> tuple[dict[str, float], dict[str, int], int]:
    """(median seconds by measurement, stored bytes over the four epochs by layout, raw bytes)."""
    bench = EpochBench(dirs, work)
    for _ in range(reps):
        bench.repeat()
    shutil.rmtree(work / "staged", ignore_errors=True)
    return bench.medians(), bench.stored, bench.raw

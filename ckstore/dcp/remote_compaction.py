"""After a save lands on a remote: the previous save's chunks become deltas of the new ones, on
the remote itself (``remote.compaction.compact_remote``), so a bucket fed only by DCP saves holds
what a compacted local repository would.

The coordinator starts it once the branch has moved, in one of three ways (``Writer(...,
compact=...)``):

- ``"background"`` (the default): a detached process on the coordinator's machine
  (``python -m ckstore.dcp.remote_compaction URL COMMIT``), so ``dcp.save`` returns as soon as
  the save is durable and the training loop never waits for the re-encoding. Runs on one
  machine take a lock file in turn (in the remote's folder of the cache folder, else a private
  folder under the temporary one), so two saves' compactions never race each other; a run
  killed part-way leaves every object readable and that pair of saves partly whole (the remote
  stays correct, only larger; the design of compact_remote). It runs at the lowest priority
  (``SCHED_IDLE``, nice 19: runtime/priority.py), set before it does any work: its re-encoding
  (tens of CPU seconds for a large save) would otherwise compete with the next save and the
  training steps for the same cores, and it has no deadline;
- ``"inline"``: in ``finish``, before ``dcp.save`` returns (tests, benchmarks, a last save);
- ``"off"``: never (the remote keeps every save as its ranks uploaded it).

The re-encoding reads the new save and its parent lazily from the remote (through the cache
folder when there is one, which each run then bounds: cache.py) and only the chunks it pairs;
nothing in it is trusted without being decoded and re-hashed (lazy.py).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ckstore.backend.local import LocalBackend
from ckstore.dcp.cache import COMPACTION, COMPACTION_LOCK, cut_log, prune_indexes, remove_stale
from ckstore.dcp.remote import RemoteTarget, cache_folder
from ckstore.errors import CkstoreError, InvalidInputError
from ckstore.remote.compaction import RemoteCompactReport, compact_remote
from ckstore.remote.layout import RemoteRepo
from ckstore.runtime.priority import lowest
from ckstore.write.background import wait_all

MODES = ("background", "inline", "off")
LOG_NAME = "remote-compact.log"
_started: list[subprocess.Popen[bytes]] = []  # this process's detached runs, for ``wait_started``


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidInputError(f"compact={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def _private_folder(cache_dir: str | None) -> Path:
    """Where this machine's runs keep their lock and log: the cache folder (``cache_dir``, else
    ``CKSTORE_CACHE_DIR``), else a folder of this user's own under the temporary folder."""
    chosen = cache_folder(cache_dir)
    if chosen is not None:
        chosen.mkdir(parents=True, exist_ok=True)
        return chosen
    folder = Path(tempfile.gettempdir()) / f"ckstore-remote-compact-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise InvalidInputError(f"{folder} is not a private folder of this user's; pass cache_dir=")
    return folder


def lock_path(target: RemoteTarget) -> Path:
    """The lock this machine's runs on ``target``'s remote take in turn: in the remote's folder
    of the cache folder (cache.py), else in this user's private folder."""
    own = target.cache_path()
    if own is not None:
        return own / COMPACTION_LOCK
    return _private_folder(None) / f"remote-compact-{hashlib.sha256(target.url.encode()).hexdigest()[:16]}.lock"


def compact_now(target: RemoteTarget, commit: str) -> RemoteCompactReport:
    """Re-encode ``commit``'s parent as deltas of it, waiting for this machine's earlier runs;
    then bound the cache folder (cache.py)."""
    fd = os.open(lock_path(target), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        own = target.cache_path()
        remote = target.open()
        report = compact_remote(remote, commit, cache=None if own is None else own / COMPACTION)
        if own is not None:
            _bound(remote, own)
        return report
    finally:
        os.close(fd)


def _bound(remote: RemoteRepo, own: Path) -> None:
    """What the cache folder keeps once a run is done (cache.py): of this remote the index files
    of the packs it still holds, of the others those touched within a week. A failure here
    leaves the folder larger until the next run, never the compaction undone."""
    try:
        prune_indexes(LocalBackend(own), remote.pack_ids())
        remove_stale(own.parent.parent, own)
    except (CkstoreError, OSError):
        pass


def start(target: RemoteTarget, commit: str, mode: str) -> subprocess.Popen[bytes] | RemoteCompactReport | None:
    """Compact the remote after ``commit`` landed, as ``mode`` says (the module docstring)."""
    if mode == "off":
        return None
    if mode == "inline":
        return compact_now(target, commit)
    argv = [sys.executable, "-m", "ckstore.dcp.remote_compaction", target.url, commit]
    if target.endpoint_url:
        argv += ["--endpoint-url", target.endpoint_url]
    chosen = cache_folder(target.cache_dir)
    if chosen is not None:
        argv += ["--cache-dir", os.fspath(chosen)]
    log = _private_folder(target.cache_dir) / LOG_NAME
    with open(log, "ab") as out:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    _started[:] = [p for p in _started if p.poll() is None] + [child]
    return child


def wait_compaction() -> list[int]:
    """Wait until this process's compactions after DCP saves have finished, in a repository (its
    background thread) or on a remote (the detached runs it started, whose exit codes it returns:
    0 is done). A benchmark or a test that measures stored bytes calls it; only on the
    coordinator rank is there anything to wait for."""
    wait_all()
    codes = [p.wait() for p in _started]
    _started.clear()
    return codes


def main(argv: list[str] | None = None) -> int:
    """The detached run: lowest priority first, then the compaction, one line in the log."""
    priority = ", ".join(lowest()) or "normal priority"
    parser = argparse.ArgumentParser(prog="python -m ckstore.dcp.remote_compaction")
    parser.add_argument("url")
    parser.add_argument("commit")
    parser.add_argument("--endpoint-url")
    parser.add_argument("--cache-dir")
    args = parser.parse_args(argv)
    target = RemoteTarget(args.url, None, args.endpoint_url, args.cache_dir)
    try:
        cut_log(_private_folder(args.cache_dir) / LOG_NAME)
    except OSError:
        pass  # a log that cannot be cut only grows
    try:
        report = compact_now(target, args.commit)
    except CkstoreError as exc:
        print(f"ckstore: remote compaction of {args.commit[:12]} on {args.url}: {exc}", flush=True)
        return 1
    print(
        f"ckstore: remote compaction of {args.commit[:12]} on {args.url}: {report.deltas} delta(s), "
        f"{report.sent_bytes} bytes sent, {report.freed_bytes} bytes freed ({priority})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

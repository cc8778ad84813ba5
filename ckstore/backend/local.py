"""A repository in a local directory: one file per key, written atomically.

Writes go to ``tmp/`` first, are fsynced, then linked (``put_if_absent``) or renamed
(``replace``) into place, and the directory is fsynced, so a crash leaves either the old state or
the new one plus, at worst, a stray temporary file that the next gc removes.

A batch (``LocalBackend.batch``, used for a commit's chunk objects) pays for durability once
instead of per object: every object is written to ``tmp/`` without fsync, then one barrier makes
all their bytes durable (``syncfs(2)`` on the repository's filesystem; without it, an fsync of
each staged file), then each is moved to its final name without replacing anything
(``renameat2`` RENAME_NOREPLACE, else ``link``: EEXIST means another writer stored it), then a
second barrier makes the new directory entries durable (local_batch.py). So no object
ever appears under its final name before its bytes are on disk, and the caller writes its
manifest only after the batch returned. Measured: ~1,000 per-object fsyncs took 3.0 s of a
6.8 s commit; two syncfs calls take ~0.1 s.

The repository lock is ``fcntl.flock`` on the file ``lock`` (local_locks.py): the kernel drops it
when its holder dies, so a killed commit can never wedge gc. (flock is not reliable on every
network filesystem; docs/design.md says so.) Finding a repository's folder: local_location.py.

Every mutating step (write, fsync, link, rename, unlink, mkdir) goes through
``fsio.mutating_step``, the seam the crash and fault-injection tests use.
"""

from __future__ import annotations

import builtins
import os
import stat
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ckstore.backend.base import Backend, check_key, check_line, check_prefix, storage_error
from ckstore.backend.fsio import drop_cached, fsync_path, mutating_step, read_ahead, start_writeback, write_out_and_drop
from ckstore.backend.local_batch import LocalBatch, StagingBackend
from ckstore.backend.local_locks import LocalLocks
from ckstore.backend.local_packs import PACK_FOLDER, LocalPacks
from ckstore.backend.syscalls import HAS_SYNCFS, syncfs
from ckstore.format.ids import is_object_id, key_object_id, object_key
from ckstore.format.pack import MAX_PACK_SIZE

TMP_DIR = "tmp"
# Space set aside for gc on a full disk (docs/format.md section 3): what gc writes before it
# deletes (the pruned record, reflogs) must fit; a reflog line is ~150 bytes.
RESERVE_FILE = "reserve"
RESERVE_BYTES = 256 << 10


def _last_line_end(fd: int, end: int, block: int = 1 << 16) -> int:
    """Offset just past the last newline before ``end`` (0 when there is none)."""
    while end > 0:
        start = max(0, end - block)
        found = os.pread(fd, end - start, start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return 0


class LocalBackend(LocalLocks, StagingBackend):
    # Batches use syncfs(2) when the platform has it; tests turn it off to cover the fallback.
    use_syncfs: bool = HAS_SYNCFS

    # A batch expected to store at least this many bytes writes its new objects into a pack
    # (local_packs.py); smaller ones stay loose, where one file per object costs little.
    pack_min_bytes: int = 8 << 20
    # Or this many objects: a commit of many small files writes one file, not one per object
    # (their small objects then stay packed: local_settle.py).
    pack_min_objects: int = 64

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._root = str(self.root)
        self.packs = LocalPacks(self.root)
        # Set by the repository: upgrades its format so that packs are allowed, or says no.
        self.allow_packs: Callable[[], bool] | None = None

    def may_pack(self) -> bool:
        return self.allow_packs is not None and self.allow_packs()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _file(self, key: str) -> str:
        """``_path`` as a string, for the per-object hot paths (pathlib's joining and parsing
        were a sixth of a checkout's time holding the GIL)."""
        return f"{self._root}/{check_key(key)}"

    def describe(self, key: str) -> str:
        return str(self._path(key))

    def get(self, key: str) -> bytes:
        return self._read(key, None)

    def get_prefix(self, key: str, n: int) -> bytes:
        return self._read(key, n)

    def forget_cached(self, key: str) -> None:
        try:
            fd = os.open(self._file(key), os.O_RDONLY)
        except OSError:
            oid = key_object_id(key)
            if oid is not None:
                self.packs.forget_cached(oid)
            return
        try:
            drop_cached(fd)  # a whole file: every folio of it
        finally:
            os.close(fd)

    # Below this many keys, reading each is cheaper than listing the loose objects first.
    BULK_MIN = 1024

    def object_prefixes(self, oids: Collection[str], n: int) -> dict[str, bytes]:
        """Packed objects' prefixes, each pack read once (local_packs.py ``read_prefixes``); a
        loose copy shadows a packed one (``_read`` looks there first: a replaced object), so
        loose objects are left to ``get_prefix``."""
        if len(oids) < self.BULK_MIN:
            return {}
        loose = self._loose_ids()
        try:
            return self.packs.read_prefixes([oid for oid in oids if oid not in loose], n)
        except OSError as exc:
            raise storage_error(exc, f"reading the packs of {self.root}") from None

    def object_sizes(self) -> dict[str, int]:
        """Loose objects' sizes from their folders' listings (one stat each), packed ones' from
        the pack tables; a loose copy counts, as ``size`` says."""
        out = self.packs.sizes()
        try:
            for folder in self._fanout_folders():
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if _is_temporary(entry.name):
                            continue
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # deleted or settled meanwhile
                        if stat.S_ISREG(st.st_mode) and is_object_id(oid := folder.name + entry.name):
                            out[oid] = st.st_size
        except OSError as exc:
            raise storage_error(exc, f"listing the objects of {self.root}") from None
        return out

    def read_ahead(self, keys: Collection[str]) -> None:
        packed = []
        for key in keys:
            try:
                fd = os.open(self._file(key), os.O_RDONLY)
            except OSError:
                oid = key_object_id(key)
                if oid is not None:
                    packed.append(oid)
                continue
            try:
                read_ahead(fd, 0, os.fstat(fd).st_size)
            except OSError:
                pass  # advice only
            finally:
                os.close(fd)
        self.packs.read_ahead(packed)

    def superseded_bytes(self) -> int:
        try:
            return sum(self.packs.shadowed_bytes(self._loose_ids()).values()) if self.packs.indexes() else 0
        except OSError as exc:
            raise storage_error(exc, f"reading the packs of {self.root}") from None

    def _fanout_folders(self) -> list[Path]:
        objects = self.root / "objects"
        if not objects.is_dir():
            return []
        return sorted(p for p in objects.iterdir() if len(p.name) == 2 and p.is_dir())

    def _loose_ids(self) -> set[str]:
        """Names of the loose objects (listings only, no stat)."""
        out: set[str] = set()
        try:
            for folder in self._fanout_folders():
                out.update(folder.name + name for name in os.listdir(folder) if not _is_temporary(name))
        except OSError as exc:
            raise storage_error(exc, f"listing the objects of {self.root}") from None
        return out

    def _read(self, key: str, n: int | None) -> bytes:
        """A loose object, else a packed one, else (a pack settled meanwhile) the loose copy or
        the new pack's."""
        oid = key_object_id(key)
        for _ in (0, 1):
            try:
                with open(self._file(key), "rb", buffering=0) as f:
                    return f.readall() if n is None else f.read(n)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                # A folder is not a key, and no key lies below a file ("a/b" when "a" is a ref).
                if oid is None:
                    raise KeyError(key) from None
            except OSError as exc:
                raise storage_error(exc, f"reading {self.describe(key)}") from None
            try:
                packed = self.packs.read(oid, n)
            except OSError as exc:
                raise storage_error(exc, f"reading {self.describe(key)} from its pack") from None
            if packed is not None:
                return packed
        raise KeyError(key)

    def _fsync_dir(self, path: Path) -> None:
        mutating_step()
        fsync_path(path)

    def _ensure_dir(self, path: Path, created: set[Path] | None = None) -> None:
        """Create ``path`` and missing parents. Each new entry's parent is fsynced at once,
        unless ``created`` collects the new folders for the caller's own barrier (batches)."""
        if path.is_dir():
            return
        self._ensure_dir(path.parent, created)
        mutating_step()
        try:
            os.mkdir(path)
        except FileExistsError:
            return
        if created is None:
            self._fsync_dir(path.parent)
        else:
            created.add(path)

    def _write_temp(
        self, data: bytes | memoryview, sync: bool = True, folder: Path | None = None, cached: bool = True
    ) -> Path:
        """A new temporary file holding ``data``, in ``tmp/`` or in ``folder`` (an existing
        folder of the repository) under a name that starts with a dot, which no key has.
        Unsynced, its writeback is started at once; unless ``cached``, it is waited for and the
        file's pages leave the page cache (fsio.write_out_and_drop)."""
        tmp_dir = self.root / TMP_DIR if folder is None else folder
        tmp = tmp_dir / f".{os.urandom(16).hex()}.tmp"  # as unique as uuid4, which costs an import
        mutating_step()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # no tmp/ yet: made on demand, not checked before every write
            self._ensure_dir(tmp_dir)
            fd = os.open(tmp, flags, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                mutating_step()
                os.fsync(fd)
            elif not cached:
                write_out_and_drop(fd)
            else:
                start_writeback(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp

    def _install(self, key: str, data: bytes, exclusive: bool) -> bool:
        path = self._path(key)
        tmp: Path | None = None
        try:
            self._ensure_dir(path.parent)
            written = tmp = self._write_temp(data)
            for attempt in range(3):
                mutating_step()
                try:
                    if exclusive:
                        os.link(written, path)
                    else:
                        os.replace(written, path)
                        tmp = None
                    break
                except FileExistsError:
                    return False
                except FileNotFoundError:
                    if attempt == 2 or not written.exists():
                        raise
                    self._ensure_dir(path.parent)  # a ref deletion pruned the empty folder meanwhile
            self._fsync_dir(path.parent)
            return True
        except OSError as exc:
            raise storage_error(exc, f"writing {self.describe(key)}") from None
        finally:
            if tmp is not None:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass  # a stray temporary file is harmless; gc removes it

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if self._path(key).exists():
            return False
        return self._install(key, data, exclusive=True)

    def replace(self, key: str, data: bytes) -> None:
        self._install(key, data, exclusive=False)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        return self._install(key, data, exclusive=True)

    def append_line(self, key: str, line: bytes) -> None:
        """Append in place: the file is never rewritten, so a long reflog costs one write."""
        path = self._path(check_key(key))
        check_line(line)
        try:
            self._ensure_dir(path.parent)
            mutating_step()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                end = new_file_end = os.fstat(fd).st_size
                if end and os.pread(fd, 1, end - 1) != b"\n":
                    end = _last_line_end(fd, end)
                    mutating_step()
                    os.ftruncate(fd, end)  # a line torn by a crash: it must not run into ours
                view = memoryview(line)
                mutating_step()
                while view:
                    written = os.pwrite(fd, view, end)
                    view, end = view[written:], end + written
                mutating_step()
                os.fsync(fd)
            finally:
                os.close(fd)
            if not new_file_end:  # the file may be new: make its directory entry durable too
                self._fsync_dir(path.parent)
        except OSError as exc:
            raise storage_error(exc, f"appending to {self.describe(key)}") from None

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            mutating_step()
            path.unlink()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return False
        except OSError as exc:
            raise storage_error(exc, f"deleting {self.describe(key)}") from None
        return True

    def prune_folders(self, key: str, stop: str) -> None:
        path, top = self._path(key).parent, self.root / check_key(stop)
        while path != top and top in path.parents:
            mutating_step()
            try:
                os.rmdir(path)
            except OSError:
                return  # not empty (another ref, or a writer's new lock file), or gone already
            path = path.parent

    def size(self, key: str) -> int | None:
        try:
            st = os.stat(self._file(key))
        except (FileNotFoundError, NotADirectoryError):
            oid = key_object_id(key)
            return None if oid is None else self.packs.size(oid)
        except OSError as exc:
            raise storage_error(exc, f"reading {self.describe(key)}") from None
        return None if stat.S_ISDIR(st.st_mode) else st.st_size

    def list(self, prefix: str) -> Iterator[str]:
        prefix = check_prefix(prefix)  # never a path outside the repository
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            if rel in (TMP_DIR, PACK_FOLDER):  # packs are files, not keys: their objects are listed below
                dirnames.clear()
                continue
            keys.extend(name if rel == "." else f"{rel}/{name}" for name in filenames if not _is_temporary(name))
        if "objects/".startswith(prefix) or prefix.startswith("objects/"):
            loose = set(keys)
            keys.extend(k for k in map(object_key, self.packs.ids()) if k.startswith(prefix) and k not in loose)
        # Sorted as whole keys (os.walk yields a folder's files before its subfolders').
        yield from sorted(keys)

    @contextmanager
    def batch(self, expected_bytes: int = 0, expected_objects: int = 0) -> Iterator[Backend]:
        many = expected_bytes >= self.pack_min_bytes or expected_objects >= self.pack_min_objects
        staged = LocalBatch(self, pack_below=MAX_PACK_SIZE if many else 0)
        try:
            yield staged
            staged.flush()  # inside: a Ctrl-C as flush starts must still discard the batch
        except BaseException:
            staged.discard()  # after a failed flush, what it took it removed: nothing is left here
            raise

    def storage_problems(self) -> builtins.list[str]:
        self.packs.refresh(force=True)
        return [
            f"pack {self.packs.path_of(pid)} is damaged and was left out: {why}"
            for pid, why in sorted(self.packs.damaged.items())
        ]

    def unpack(self, drop: Collection[str] = (), gather: bool = False, keep_clean: bool = False) -> int:
        """Settle the installed packs (local_settle.py): large objects spread into loose ones,
        small ones kept in (at most one new) pack, ``drop``'s objects left out; ``gather`` also
        packs loose small objects; ``keep_clean`` leaves packs with no stale or dropped object
        as they are. Return how many packs were removed. Every kept object is
        durable in its new place before an old copy goes; the caller holds a repository lock
        that keeps other settlers out (compaction's, or gc's exclusive one)."""
        from ckstore.backend.local_settle import settle  # writers only

        try:
            return settle(self, drop, gather, keep_clean)
        except OSError as exc:
            raise storage_error(exc, f"settling the packs of {self.root}") from None

    def release_reserve(self) -> int:
        path = self.root / RESERVE_FILE
        try:
            size = path.stat().st_size
            mutating_step()
            path.unlink()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise storage_error(exc, f"deleting {path}") from None
        return size

    def keep_reserve(self) -> bool:
        path = self.root / RESERVE_FILE
        try:
            if path.stat().st_size >= RESERVE_BYTES:
                return True
        except FileNotFoundError:
            pass
        except OSError:
            return False
        try:
            # Real pages, not a sparse file (which would free nothing when deleted); not synced:
            # a crash that loses it only loses the reserve, which the next gc sets aside again.
            tmp = self._write_temp(bytes(RESERVE_BYTES), sync=False)
            mutating_step()
            os.rename(tmp, path)
        except OSError:
            return False  # the disk is full: the next gc sets it aside
        return True

    def drop_packed(self, oids: Collection[str]) -> int:
        from ckstore.backend.local_settle import settle  # writers only

        try:
            return settle(self, oids, only_dropping=True)
        except OSError as exc:
            raise storage_error(exc, f"rewriting the packs of {self.root}") from None

    def packed_prefixes(self, oids: Collection[str], n: int) -> dict[str, builtins.list[bytes]]:
        try:
            return self.packs.every_prefix(oids, n)
        except OSError as exc:
            raise storage_error(exc, f"reading the packs of {self.root}") from None

    def sync_barrier(self, paths: Iterable[Path], targeted: bool = False) -> None:
        """Make ``paths`` (files or folders written under the repository) durable: one syncfs(2)
        of the repository's filesystem, or, when ``targeted`` (a few files: local_batch.py) or
        where the platform lacks syncfs, an fsync of each, run concurrently so the filesystem can
        commit them together."""
        if self.use_syncfs and not targeted:
            mutating_step()
            if syncfs(self.root):
                return
        todo = sorted(set(paths))
        for _ in todo:
            mutating_step()  # one step per fsync, counted up front (the fsyncs run in parallel)
        from concurrent.futures import ThreadPoolExecutor  # writers only: reading commands start without it

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(fsync_path, todo))

    def clean_temporary(self) -> int:
        removed = 0
        for entry in self._temporaries():
            try:
                entry.unlink()
                removed += 1
            except OSError:
                pass
        return removed

    def state_signature(self, settled_before: float) -> builtins.list[tuple[str, int, int]] | None:
        # Adding, replacing (rename) or deleting an object changes its fan-out folder's mtime;
        # packs change in place, so each pack file counts with its own. About 260 stats.
        # Not tmp/: writing the cache itself stages a file there.
        paths = [
            self.root / name for name in ("config.json", "pruned", "dependents", "alternates", "objects", PACK_FOLDER)
        ]
        paths += sorted((self.root / "objects").glob("[0-9a-f][0-9a-f]"))
        for folder in (self.root / PACK_FOLDER, self.root / "logs"):
            if folder.is_dir():
                paths += sorted(p for p in folder.rglob("*") if p.is_file())
        out = []
        limit = int(settled_before * 1e9) if settled_before < float("inf") else 1 << 63
        for path in paths:
            try:
                st = path.stat()
            except FileNotFoundError:
                out.append((path.relative_to(self.root).as_posix(), -1, -1))
                continue
            if st.st_mtime_ns >= limit:
                return None
            out.append((path.relative_to(self.root).as_posix(), st.st_mtime_ns, st.st_size))
        return out

    def temporary_sizes(self) -> builtins.list[int]:
        sizes = []
        for entry in self._temporaries():
            try:
                sizes.append(entry.stat().st_size)
            except OSError:
                continue  # removed meanwhile
        return sizes

    def _temporaries(self) -> Iterator[Path]:
        # Batches stage objects in their own fan-out folders (local_batch.py) and packs in the
        # pack folder; everything else writes its temporaries in tmp/.
        folders = [
            self.root / TMP_DIR,
            *sorted((self.root / "objects").glob("[0-9a-f][0-9a-f]")),
            self.root / PACK_FOLDER,
        ]
        for folder in folders:
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if folder.name == TMP_DIR or _is_temporary(entry.name):
                    yield entry


def _is_temporary(name: str) -> bool:
    """A staging file beside an object (``_write_temp`` with a folder): never a key."""
    return name.startswith(".") and name.endswith(".tmp")

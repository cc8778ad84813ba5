"""numba's kernel cache is read with pickle: ckstore caches its kernels only in a folder nobody
else can write (runtime/kernel_cache.py)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ckstore.runtime.kernel_cache import choose, unsafe_reason

SOURCE = Path(__file__).resolve().parents[2] / "ckstore" / "codecs" / "context_kernels.py"

# Loads context_kernels and runs one kernel: numba compiles it, or loads it from its cache.
_RUN_KERNEL = (
    "import numpy as np; from ckstore.codecs import context_kernels as k; "
    "k.exponent_keys(np.arange(64, dtype=np.uint32), np.zeros(64, dtype=np.uint16))"
)


class _Evil:
    """What another user of a shared cache folder writes in place of numba's index."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"echo ran > {self.marker}",))


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env, "PYTHONPATH": str(SOURCE.parents[2])}
    for name in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run([sys.executable, "-c", _RUN_KERNEL], env=full, capture_output=True, text=True, timeout=300)


def _poisoned_cache(folder: Path, marker: Path) -> None:
    """A cache folder numba filled with the kernel, whose index files then became a hostile pickle."""
    folder.mkdir(mode=0o700)
    assert _run({"NUMBA_CACHE_DIR": str(folder)}).returncode == 0
    index = list(folder.rglob("*.nbi"))
    assert index, "numba cached nothing"
    for f in index:
        f.write_bytes(pickle.dumps(_Evil(marker)))


def test_a_private_folder_passes_and_folders_others_can_write_do_not(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    assert unsafe_reason(private) == ""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "writable by other users" in unsafe_reason(shared)
    link = tmp_path / "link"
    link.symlink_to(private)
    assert "symlink" in unsafe_reason(link)
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o775)
    (open_parent / "inner").mkdir(mode=0o700)
    assert "writable by other users" in unsafe_reason(open_parent / "inner")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "not a folder" in unsafe_reason(a_file)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_owned_by_another_user_does_not_pass(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    assert "owned by another user" in unsafe_reason(theirs)


def test_an_entry_others_can_write_inside_an_enterable_folder_does_not_pass(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o755)
    entry = folder / "codecs_x"
    entry.mkdir()
    entry.chmod(0o777)
    assert "writable by other users" in unsafe_reason(folder, [entry])
    folder.chmod(0o700)  # nobody else can reach the entry any more
    assert unsafe_reason(folder, [entry]) == ""


def test_without_numba_cache_dir_the_kernels_go_to_a_private_folder_of_the_user(tmp_path: Path) -> None:
    cache = choose(SOURCE, {"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert cache.folder == tmp_path / "xdg" / "ckstore" / "numba"
    assert cache.folder.stat().st_mode & 0o777 == 0o700
    assert choose(SOURCE, {"NUMBA_CACHE_DIR": str(tmp_path / "missing")}).folder is None
    assert choose(SOURCE, {"NUMBA_CACHE_LOCATOR_CLASSES": "InTreeCacheLocator"}).folder is None


@pytest.mark.slow
def test_a_poisoned_cache_in_a_folder_others_can_write_or_behind_a_symlink_is_never_read(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    folder = tmp_path / "shared-numba-cache"
    _poisoned_cache(folder, marker)

    folder.chmod(0o777)  # a shared folder: anyone could have written the index
    run = _run({"NUMBA_CACHE_DIR": str(folder)})
    assert run.returncode == 0, run.stderr
    assert not marker.exists()
    assert "not cached on disk" in run.stderr and "writable by other users" in run.stderr

    folder.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(folder)
    run = _run({"NUMBA_CACHE_DIR": str(link)})
    assert run.returncode == 0, run.stderr
    assert not marker.exists()
    assert "symlink" in run.stderr

    # The same cache in a folder only this user can write is read (the test can see a read).
    run = _run({"NUMBA_CACHE_DIR": str(folder)})
    assert marker.exists()


def test_the_default_cache_is_used_by_later_processes(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert _run(env).returncode == 0
    folder = tmp_path / "xdg" / "ckstore" / "numba"
    assert list(folder.rglob("*.nbi")), "the kernel was not cached in the private folder"
    assert folder.stat().st_mode & 0o777 == 0o700

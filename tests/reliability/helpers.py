"""Shared machinery of the reliability suite: running the real CLI, making checkpoints without
torch, and the oracle that decides whether a repository kept its promises."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import resource
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import ckstore.write.commit
import ckstore.write.provenance
from ckstore.format.safetensors import emit_header
from ckstore.repo import Repo
from ckstore.repository.store import object_key

# Figures for docs/reliability.md (written out by conftest.py when CKSTORE_RELIABILITY_REPORT is set).
COUNTS: Counter[str] = Counter()

# The CLI with the tests' fault injection (CKSTORE_FAULT / CKSTORE_FAULT_COUNT, see tests/fault_cli.py).
CLI = (sys.executable, str(Path(__file__).resolve().parent.parent / "fault_cli.py"))
MEMORY_LIMIT = 1 << 30
TEMP_SUFFIXES = (".ckstore-tmp", ".tmp")


def count(key: str, n: int = 1) -> None:
    COUNTS[key] += n


# ---- running the command line ---------------------------------------------------------------


def cli_env(**extra: str) -> dict[str, str]:
    """The test's environment without any CKSTORE_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKSTORE_")}
    env.update(extra)
    return env


def limit_address_space() -> None:
    """preexec_fn: cap the child's address space at 1 GiB (hostile-input cases)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_cli(
    *args: str | os.PathLike[str],
    repo: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
    limit_memory: bool = False,
) -> subprocess.CompletedProcess[str]:
    argv = [*CLI, *(["--repo", str(repo)] if repo is not None else []), *map(str, args)]
    return subprocess.run(
        argv,
        env=dict(env) if env is not None else cli_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_address_space if limit_memory else None,
        check=False,
    )


def assert_clean_error(proc: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    """The CLI contract for a failure: exit ``code``, one line ``ckstore: …`` on stderr, no traceback."""
    err = proc.stderr
    assert proc.returncode == code, (proc.returncode, err, proc.stdout)
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("ckstore: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return lines[0]


# ---- checkpoints without torch --------------------------------------------------------------


def st_bytes(tensors: Sequence[tuple[str, str, Sequence[int], bytes]], metadata: dict[str, str] | None = None) -> bytes:
    """A valid safetensors file holding ``(name, dtype, shape, data)`` in this order."""
    header, _ = emit_header([(n, d, s) for n, d, s, _ in tensors], metadata)
    return header + b"".join(data for *_, data in tensors)


def _floats(seed: int, n: int) -> bytes:
    """``n`` F32 values that compress a little, like real weights (random low bytes)."""
    rng = random.Random(seed)
    return b"".join(rng.randbytes(2) + b"\x80\x3f" for _ in range(n))


def checkpoint_bytes(seed: int, n: int = 1536) -> bytes:
    """A small checkpoint: one tensor shared by every seed (dedup), two that depend on ``seed``."""
    return st_bytes(
        [
            ("frozen.w", "F32", [n], _floats(1_000_003, n)),
            ("model.w", "F32", [n], _floats(seed, n)),
            ("model.b", "F16", [8, 4], random.Random(seed + 7).randbytes(64)),
        ],
        metadata={"seed": str(seed)},
    )


def write_checkpoint(folder: Path, seed: int, n: int = 1536) -> dict[str, str]:
    """Write ``model.safetensors`` and ``config.json`` into ``folder``; return their digests."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(checkpoint_bytes(seed, n))
    (folder / "config.json").write_text(f'{{"seed": {seed}}}\n')
    return tree_digest(folder)


@contextmanager
def reproducible_commits() -> Iterator[None]:
    """Commits made inside get the same ids in every run, on every machine.

    A commit id hashes the commit time and the provenance (host, user, the git commit of the
    working directory). Drawn inputs that map onto ids or object sizes (which object to damage,
    which byte) would pick different targets each run: hypothesis could neither replay an
    example nor keep a derandomized run the same. Time here is one second per commit from a fixed
    start, so ids stay distinct.
    """
    ticks = itertools.count()
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def clock() -> str:
        return (start + timedelta(seconds=next(ticks))).isoformat(timespec="microseconds").replace("+00:00", "Z")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckstore.write.commit, "now_iso", clock)  # raises if the name moves: update it here
        patch.setattr(ckstore.write.provenance, "collect", lambda cwd=None: {"ckstore": "test", "python": "3"})
        yield


# ---- the oracle ----------------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_temp(path: Path) -> bool:
    return path.name.endswith(TEMP_SUFFIXES)


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``root``, temporaries excluded."""
    return {
        p.relative_to(root).as_posix(): sha256(p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and not is_temp(p)
    }


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and is_temp(p)]


def refs_of(repo_path: Path) -> dict[str, str]:
    """Every ref (``refs/heads/x``, ``refs/tags/y``) and the id it holds, read as raw files."""
    out = {}
    base = repo_path / "refs"
    for p in sorted(base.rglob("*")) if base.is_dir() else []:
        if p.is_file() and not p.name.endswith(".lock"):
            out[p.relative_to(repo_path).as_posix()] = p.read_text().strip()
    return out


def ref_locks(repo_path: Path) -> list[Path]:
    head = repo_path / "HEAD.lock"  # switch locks HEAD
    return sorted((repo_path / "refs").rglob("*.lock")) + ([head] if head.exists() else [])


def checkout_digest(repo: Repo, oid: str, scratch: Path) -> dict[str, str]:
    out = scratch / f"co-{oid[:16]}"
    shutil.rmtree(out, ignore_errors=True)
    repo.checkout(oid, out)
    digest = tree_digest(out)
    shutil.rmtree(out)
    return digest


def verify_repo(
    repo_path: Path,
    contents: Mapping[str, Mapping[str, str]],
    allowed: Mapping[str, set[str | None]],
    scratch: Path,
) -> Repo:
    """The promises after any interruption.

    * ``fsck --read-data`` reports nothing;
    * every ref holds one of the values ``allowed`` lists for it (None: absent), no other ref exists;
    * every commit reachable from a ref checks out byte-identical to ``contents[commit]``.
    """
    repo = Repo(repo_path)
    problems = repo.fsck(read_data=True)
    assert problems == [], problems
    refs = refs_of(repo_path)
    for ref in set(refs) | set(allowed):
        assert ref in allowed, f"unexpected ref {ref}"
        assert refs.get(ref) in allowed[ref], (ref, refs.get(ref), allowed[ref])
    for oid in repo.reachable_commits():
        assert oid in contents, f"commit {oid} was never made"
        assert checkout_digest(repo, oid, scratch) == contents[oid], oid
    return repo


def object_path(repo_path: Path, oid: str) -> Path:
    return repo_path / object_key(oid)


def flip_bit(path: Path, offset: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))

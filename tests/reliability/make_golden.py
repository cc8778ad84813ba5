"""Generate the golden damaged repositories in tests/reliability/golden/ (run from the repo root).

    python tests/reliability/make_golden.py

Each case is a tiny repository (two commits on ``main``, tag ``v1`` on the first; times and
provenance fixed, so the ids are reproducible) with one deliberate damage, plus ``expected.json``:
the exact ``ckstore fsck --read-data`` output, which refs still check out and with which sha256,
and the exit code and message fragment of checking out the damaged one. test_golden.py replays
them; regenerate only when the format changes on purpose, and review the diff of expected.json.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import ckstore.write.commit  # noqa: E402
import ckstore.write.provenance  # noqa: E402
from ckstore.format.safetensors import emit_header  # noqa: E402
from ckstore.repo import Repo  # noqa: E402
from ckstore.repository.store import object_key  # noqa: E402

GOLDEN = HERE / "golden"


def _fixed_clock() -> Callable[[], str]:
    ticks = iter(range(10**6))
    return lambda: f"2026-01-01T00:00:{next(ticks):02d}.000000Z"


def _checkpoint(folder: Path, epoch: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = [("frozen", "U8", [64], bytes(range(64))), ("w", "F32", [32], bytes([epoch]) * 128)]
    header, _ = emit_header([(n, d, s) for n, d, s, _ in tensors], {"epoch": str(epoch)})
    (folder / "model.safetensors").write_bytes(header + b"".join(t[3] for t in tensors))
    (folder / "config.json").write_text(f'{{"epoch": {epoch}}}\n')


def _base(root: Path) -> tuple[Repo, list[str]]:
    ckstore.write.commit.now_iso = _fixed_clock()
    ckstore.write.provenance.collect = lambda cwd=None: {"ckstore": "golden", "python": "3", "hostname": "golden"}
    repo = Repo.init(root / "repo", chunk_size=4096, zstd_level=3)
    ids = []
    for epoch in (1, 2):
        _checkpoint(root / "src", epoch)
        ids.append(repo.commit([root / "src"], message=f"epoch {epoch}"))
        shutil.rmtree(root / "src")
    repo.create_tag("v1", ids[0])
    return repo, ids


def _chunk_of(repo: Repo, commit: str, tensor: str) -> str:
    f = repo.read_commit(commit).files[1]  # model.safetensors (files are sorted by path)
    return next(t for t in f.tensors if t.name == tensor).chunks[0].id


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def bitflip_chunk(repo: Repo, ids: list[str]) -> str:
    oid = _chunk_of(repo, ids[1], "w")
    _flip(repo.path / object_key(oid), -1)  # type: ignore[operator]
    return "main"


def bitflip_manifest(repo: Repo, ids: list[str]) -> str:
    _flip(repo.path / object_key(ids[1]), -8)  # type: ignore[operator]
    return "main"


def truncated_object(repo: Repo, ids: list[str]) -> str:
    oid = _chunk_of(repo, ids[1], "w")
    path = repo.path / object_key(oid)  # type: ignore[operator]
    path.write_bytes(path.read_bytes()[:-5])
    return "main"


def missing_object(repo: Repo, ids: list[str]) -> str:
    (repo.path / object_key(_chunk_of(repo, ids[1], "w"))).unlink()  # type: ignore[operator]
    return "main"


def corrupt_ref(repo: Repo, ids: list[str]) -> str:
    (repo.path / "refs/heads/main").write_text(ids[1][:-1] + "x\n")  # type: ignore[operator]
    return "main"


CASES = [bitflip_chunk, bitflip_manifest, truncated_object, missing_object, corrupt_ref]


def _cli(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckstore.cli", "--repo", str(repo), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=repo.parent,
    )


def main() -> None:
    import hashlib

    shutil.rmtree(GOLDEN, ignore_errors=True)
    for damage in CASES:
        case = GOLDEN / damage.__name__.replace("_", "-")
        repo, ids = _base(case)
        damaged_ref = damage(repo, ids)
        shutil.rmtree(repo.path / "tmp", ignore_errors=True)  # type: ignore[operator]
        (repo.path / "lock").unlink(missing_ok=True)  # type: ignore[operator]
        fsck = _cli(case / "repo", "fsck", "--read-data")
        bad = _cli(case / "repo", "checkout", damaged_ref, "-o", str(case / "out"))
        shutil.rmtree(case / "out", ignore_errors=True)
        good = {}
        for ref in ("v1",):
            _cli(case / "repo", "checkout", ref, "-o", str(case / "out"))
            good[ref] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((case / "out").iterdir())}
            shutil.rmtree(case / "out")
        expected = {
            "fsck_exit": fsck.returncode,
            "fsck_stdout": fsck.stdout.splitlines(),
            "fsck_stderr": fsck.stderr.strip(),
            "damaged_ref": damaged_ref,
            "checkout_exit": bad.returncode,
            "checkout_stderr": bad.stderr.strip(),
            "intact": good,
        }
        (case / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
        size = sum(p.stat().st_size for p in case.rglob("*") if p.is_file())
        print(f"{case.name}: {size} bytes, fsck exit {fsck.returncode}, checkout exit {bad.returncode}")


if __name__ == "__main__":
    main()

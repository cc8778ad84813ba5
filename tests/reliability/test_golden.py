"""Golden damaged repositories (made by make_golden.py): fsck and checkout output must not drift.

Each case in golden/ is a tiny repository with one deliberate damage and ``expected.json``: the
exact ``fsck --read-data`` output and exit code, the exit code and message of checking out the
damaged ref, and the sha256 of the files of a ref the damage does not reach.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from .helpers import count, run_cli

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = sorted(p.name for p in GOLDEN.iterdir() if (p / "expected.json").is_file())


def _stable(text: str) -> str:
    """The zstd library's own wording after "corrupt zstd data:" varies by version: not compared."""
    return re.sub(r"(corrupt zstd data):.*", r"\1", text)


def test_golden_repositories_exist_and_are_small() -> None:
    assert len(CASES) >= 5
    for case in CASES:
        assert sum(p.stat().st_size for p in (GOLDEN / case).rglob("*") if p.is_file()) < 8192, case


@pytest.mark.parametrize("case", CASES)
def test_golden_damage_is_reported_exactly(case: str, tmp_path: Path) -> None:
    expected = json.loads((GOLDEN / case / "expected.json").read_text())
    repo = tmp_path / "repo"
    shutil.copytree(GOLDEN / case / "repo", repo)
    fsck = run_cli("fsck", "--read-data", repo=repo)
    assert (fsck.returncode, [_stable(x) for x in fsck.stdout.splitlines()], fsck.stderr.strip()) == (
        expected["fsck_exit"],
        [_stable(x) for x in expected["fsck_stdout"]],
        expected["fsck_stderr"],
    )
    bad = run_cli("checkout", expected["damaged_ref"], "-o", tmp_path / "bad", repo=repo)
    assert (bad.returncode, _stable(bad.stderr.strip())) == (
        expected["checkout_exit"],
        _stable(expected["checkout_stderr"]),
    )
    for ref, digests in expected["intact"].items():
        out = tmp_path / f"good-{ref}"
        proc = run_cli("checkout", ref, "-o", out, repo=repo)
        assert proc.returncode == 0, proc.stderr
        assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())} == digests
    count("golden_repositories_checked")

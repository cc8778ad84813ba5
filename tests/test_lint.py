"""The code stays as its tools check it: ruff's lint rules and formatting (pyproject.toml
[tool.ruff]) and mypy's types (pyproject.toml [tool.mypy]), run as CI runs the suite, so a
change that breaks one fails here and not only in a reviewer's editor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["."]  # the whole tree: the code folders and the README's Python blocks


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def test_ruff_finds_no_lint_problem() -> None:
    result = _run("ruff", "check", "--no-cache", *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_finds_the_code_formatted() -> None:
    result = _run("ruff", "format", "--check", "--no-cache", *CHECKED)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_finds_no_type_error() -> None:
    result = _run("mypy", "--no-incremental", "--cache-dir", "/dev/null")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_every_type_ignore_says_why() -> None:
    """A silenced type error carries its reason on the same line or the line above."""
    unexplained = []
    for path in sorted((ROOT / "ckstore").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "# type: ignore" not in line:
                continue
            code, _, after = line.partition("# type: ignore")
            reason_here = "#" in after
            reason_above = i > 0 and lines[i - 1].strip().startswith("#")
            if not (reason_here or reason_above):
                unexplained.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not unexplained, "type: ignore without a reason: " + ", ".join(unexplained)

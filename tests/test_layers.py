"""The layer contract (pyproject.toml [tool.importlinter], docs/design.md "Layers") holds, and
would catch an import that runs upward or closes a cycle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def _lint(project: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project)}
    return subprocess.run([*LINT, "--config", str(project / "pyproject.toml")], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_package_keeps_its_layer_contracts() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def _copy_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "ckstore", project / "ckstore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    return project


@pytest.mark.parametrize("module, line, contract", [
    # The commit graph reaching up into the façade: the original circle.
    ("graph.py", "from . import repo", "Data flows one way"),
    # An operation importing the façade.
    ("gc.py", "from .repo import Repo", "Data flows one way"),
    # The object store importing an operation above it.
    ("store.py", "from . import checkout", "Data flows one way"),
    # The core importing torch directly.
    ("history.py", "import torch", "never imports torch"),
])
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    project = _copy_project(tmp_path)
    target = project / "ckstore" / module
    text = target.read_text()
    anchor = "from __future__ import annotations\n"
    target.write_text(text.replace(anchor, anchor + line + "  # injected by the test\n", 1))
    result = _lint(project)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and "BROKEN" in result.stdout

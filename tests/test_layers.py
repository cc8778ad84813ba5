"""The layer contract (pyproject.toml [tool.importlinter], docs/design.md "Layers") holds, and
would catch an import that runs upward or closes a cycle."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
    "--no-cache",
]


def _lint(project: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project)}
    return subprocess.run(
        [*LINT, "--config", str(project / "pyproject.toml")],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_package_keeps_its_layer_contracts() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def _copy_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "ckstore", project / "ckstore", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    return project


@pytest.mark.parametrize(
    "module, line, contract",
    [
        # The commit graph reaching up into the façade: the original circle.
        ("repository/graph.py", "from ckstore import repo", "Data flows one way"),
        # An operation importing the façade.
        ("maintenance/gc.py", "from ckstore.repo import Repo", "Data flows one way"),
        # The object store importing an operation above it.
        ("repository/store.py", "from ckstore.read import checkout", "Data flows one way"),
        # A pure format module reaching into the backend (I/O).
        ("codecs/objects.py", "from ckstore.backend import fsio", "Data flows one way"),
        # Two operations on one floor importing each other.
        ("history/log.py", "from ckstore.write import commit", "Data flows one way"),
        # A module inside a folder closing a circle with its sibling.
        ("repository/refs.py", "from ckstore.repository import context", "No import cycle"),
        # The core importing torch directly.
        ("history/log.py", "import torch", "never imports torch"),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    project = _copy_project(tmp_path)
    target = project / "ckstore" / module
    text = target.read_text()
    anchor = "from __future__ import annotations\n"
    assert anchor in text
    target.write_text(text.replace(anchor, anchor + line + "  # injected by the test\n", 1))
    result = _lint(project)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and "BROKEN" in result.stdout


def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
    return [name.strip() for row in contract["layers"] for name in re.split(r"[|:]", row)]


def test_every_module_takes_its_floor_from_a_folder_the_contract_names() -> None:
    """A module outside every row of the layer contract would be checked by nothing but the acyclic
    contract; every file under ckstore/ must sit in a folder (or be a top-level module) it names."""
    named = set(_layers())
    unplaced = []
    for path in sorted((ROOT / "ckstore").rglob("*.py")):
        parts = path.relative_to(ROOT / "ckstore").with_suffix("").parts
        if parts == ("__init__",):
            continue  # the package face itself
        if parts[0] not in named:
            unplaced.append("/".join(parts))
    assert not unplaced, f"modules outside every layer of the contract: {unplaced}"


def test_the_top_of_the_package_holds_only_its_face() -> None:
    top = sorted(p.stem for p in (ROOT / "ckstore").glob("*.py"))
    assert top == ["__init__", "errors", "version"]
    assert (ROOT / "ckstore" / "repo" / "__init__.py").exists()  # the façade, a package of its own
    for folder in (ROOT / "ckstore").iterdir():
        if folder.is_dir() and (folder / "__init__.py").exists():
            modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            # 15 since format/manifest.py and format/pack.py (over 600 lines each) were split by
            # responsibility: a module over the ~600-line limit is the worse of the two.
            assert len(modules) <= 15, f"{folder.name}/ holds {len(modules)} modules"

"""Shell completion (click's _CKSTORE_COMPLETE) completes REF arguments with branches and tags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ckstore import Repo


def _complete(cwd: Path, words: str) -> list[str]:
    env = {
        **os.environ,
        "_CKSTORE_COMPLETE": "bash_complete",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
    }
    code = "import sys; from ckstore.cli import main; sys.argv[0] = 'ckstore'; main(prog_name='ckstore')"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    return [line.split(",", 1)[1] for line in out.stdout.splitlines() if "," in line]


def test_refs_complete_with_branches_and_tags(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / ".ckstore")
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(tmp_path / "m.safetensors"))
    repo.commit([tmp_path / "m.safetensors"])
    repo.create_branch("exp-lr=3e-4")
    repo.create_tag("best")
    assert _complete(tmp_path, "ckstore checkout ") == ["HEAD", "best", "exp-lr=3e-4", "main"]
    assert _complete(tmp_path, "ckstore log ex") == ["exp-lr=3e-4"]
    assert _complete(tmp_path, "ckstore diff main b") == ["best"]
    assert _complete(tmp_path / "..", "ckstore show ") == []  # no repository here: nothing, no error

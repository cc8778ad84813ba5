"""``python tests/reliability/system_driver.py REPO``: a long-lived Python writer for the system test.

It reads one JSON request per line on stdin, runs it through ``ckstore.Repo`` and answers one JSON
line on stdout, flushed: ``{"ok": true, "oid": …}`` or ``{"ok": false, "code": N, "error": …}``.
An answer read in full is the acknowledgement (system.py kills this process at random moments,
so an operation cut short has no answer). One process runs many operations, as a training job
does, which is also what lets the soak reach thousands of operations on a small machine.

Requests: ``state`` (``commit_state``, optionally in the background), ``commit`` (a folder),
``compact`` (a branch's tip and its parent), ``push`` (answers the ref's value it pushed).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout under test

from ckstore.errors import CkstoreError  # noqa: E402
from ckstore.repo import Repo  # noqa: E402


def state_for(seed: int, n: int) -> dict[str, Any]:
    """The training state committed for ``seed``: a frozen array shared by every seed (dedup),
    two that depend on it, and scalars."""
    frozen = np.random.default_rng(1_000_003).standard_normal(n).astype(np.float32)
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "frozen": frozen,
            "w": rng.standard_normal(n).astype(np.float32),
            "b": rng.standard_normal(32).astype(np.float16),
        },
        "optimizer": {"step": seed, "lr": random.Random(seed).random()},
    }


def same_state(loaded: Any, expected: Any) -> bool:
    """Bit-exact equality of a loaded state and the one committed (arrays by dtype, shape, bytes)."""
    if isinstance(expected, dict):
        return (
            isinstance(loaded, dict)
            and loaded.keys() == expected.keys()
            and all(same_state(loaded[k], v) for k, v in expected.items())
        )
    if isinstance(expected, np.ndarray):
        array = np.asarray(loaded)
        return array.dtype == expected.dtype and array.shape == expected.shape and array.tobytes() == expected.tobytes()
    return type(loaded) is type(expected) and loaded == expected


def serve(repo: Repo, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    meta = {"loss": request.get("loss", 0.0)}
    if op == "state":
        state = state_for(request["seed"], request["n"])
        if request.get("background"):
            handle = repo.commit_state(
                state, f"s{request['seed']}", branch=request["branch"], metadata=meta, background=True
            )
            oid = handle.result()
            repo.wait()  # its compaction too, so a kill can land in either
        else:
            oid = repo.commit_state(state, f"s{request['seed']}", branch=request["branch"], metadata=meta)
        return {"oid": oid}
    if op == "commit":
        return {"oid": repo.commit(request["dir"], f"s{request['seed']}", branch=request["branch"], metadata=meta)}
    if op == "compact":
        repo.compact(request["branch"])
        return {}
    if op == "push":
        value = repo.branches()[request["ref"]]
        repo.push(request["remote"], [request["ref"]])
        return {"oid": value}
    raise ValueError(f"unknown request {op!r}")


def main(repo_path: str) -> None:
    repo = Repo(repo_path)
    for line in sys.stdin:
        try:
            answer = {"ok": True, **serve(repo, json.loads(line))}
        except CkstoreError as exc:
            answer = {"ok": False, "code": exc.exit_code, "error": str(exc)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])

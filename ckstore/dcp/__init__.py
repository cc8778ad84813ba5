"""Distributed checkpoints: ckstore as a torch.distributed.checkpoint storage backend.

``Writer`` and ``Reader`` (storage.py) import torch; they are loaded on first access so that
importing this package for its torch-free parts stays light.

Where a save or load goes (location.py): ``Writer(repo)`` / ``Reader(repo, ref=...)``, or a
checkpoint path as DCP call sites pass it, ``dcp.save(state, checkpoint_id=PATH,
storage_writer=Writer())`` and ``dcp.load(state, checkpoint_id=PATH, storage_reader=Reader())``:

- ``PATH = <repo>``: the save commits on the current branch (or the Writer's ``branch``); the
  load reads HEAD.
- ``PATH = <repo>/<name>``: the save commits on branch ``<name>`` if it exists, else on the
  current branch (or ``branch``) and points tag ``<name>`` at the commit, moving it if it
  existed; the load reads ``<name>`` (branch, tag or commit id).

A remote URL instead of a repository (``s3://bucket/prefix[/name]``, ``file:///folder[/name]``)
saves and loads straight to that remote, for ranks on machines that share no folder
(remote.py; the same ``<remote>/<name>`` reading, branch ``main`` by default): each rank
uploads what the remote lacks, the coordinator moves the branch by compare-and-swap as a push
does, and a load reads only the chunks each rank needs. ``cache_dir=`` (or ``CKSTORE_CACHE_DIR``)
names a node-local cache folder, never needed for correctness; ``latest(URL)`` is the commit a
load of URL would read (None before the first save), where a training script resumes from.

``checkpoint_path(PATH)`` returns that reading (``CheckpointPath(repo, name)``, or None when no
prefix of PATH is a repository) for managers that build on it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointPath", "Reader", "Writer", "checkpoint_path", "latest", "saved_commit", "wait_compaction"]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointPath", "checkpoint_path"):
        from ckstore.dcp import location

        return getattr(location, name)
    if name == "latest":
        from ckstore.dcp.remote import latest

        return latest
    if name == "wait_compaction":
        from ckstore.dcp.remote_compaction import wait_compaction

        return wait_compaction
    if name in __all__:
        from ckstore.dcp import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

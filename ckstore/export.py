"""Choosing what a checkout writes: the commit's files as committed (optionally only some
tensors), Hugging Face shards, or the base model with a LoRA adapter merged in."""

from __future__ import annotations

from collections.abc import Sequence

from .checkout import Output, plan_outputs
from .dcp.consolidate import plan_consolidated
from .errors import InvalidInputError
from .lora import plan_merged
from .manifest import Commit
from .shards import parse_size, plan_shards
from .store import ObjectStore


def plan_checkout(
    store: ObjectStore, commit: Commit, only: Sequence[str] | None = None, shard_size: int | str | None = None,
    merge_lora: bool = False,
) -> list[Output]:
    if merge_lora:
        if shard_size is not None or only:
            raise InvalidInputError("merge_lora cannot be combined with shard_size or only")
        return plan_merged(store, commit)
    if commit.dcp is not None:  # a distributed checkpoint: its full tensors, not the ranks' pieces
        return plan_consolidated(store, commit, only, None if shard_size is None else parse_size(shard_size))
    if shard_size is not None:
        return plan_shards(store, commit, parse_size(shard_size), only)
    return plan_outputs(store, commit, only)

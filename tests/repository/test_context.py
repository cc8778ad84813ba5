"""Repository format upgrades (RepoContext.upgrade, docs/format.md compatibility): whatever raises
the version (compaction's predicted deltas, a fetch landing them, a local pack) goes through one
lock, so two upgrades racing never leave the repository at the lower version."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from ckstore.codecs.objects import Encoding
from ckstore.compaction.pairing import Upgrade
from ckstore.format.settings import CONFIG_KEY, PACKS_VERSION, PREDICTED_VERSION
from ckstore.remote.fetch import _allow_encoding
from ckstore.repo import Repo
from ckstore.repository.context import RepoContext, open_context

UPGRADES_TO_PREDICTED: dict[str, Callable[[RepoContext], object]] = {
    "compaction": lambda ctx: Upgrade(ctx)(),
    "fetch": lambda ctx: _allow_encoding(ctx, Encoding.PREDICTED),
}


@pytest.mark.parametrize("upgrade", list(UPGRADES_TO_PREDICTED))
def test_an_upgrade_to_predicted_racing_one_to_packs_never_lowers_the_version(tmp_path: Path, upgrade: str) -> None:
    Repo.init(tmp_path / "repo")
    ctx = open_context(tmp_path / "repo")
    assert ctx.config.version == 2
    write_config = ctx.backend.replace
    slow = threading.Event()  # the predicted upgrade is writing config.json
    packs_done = threading.Event()

    def replace(key: str, data: bytes) -> None:
        # The upgrade to 4 stalls while writing config.json; without one lock for both, the
        # upgrade to 5 completes meanwhile and the stalled write then lowers the version.
        if key == CONFIG_KEY and json.loads(data)["version"] == PREDICTED_VERSION:
            slow.set()
            packs_done.wait(timeout=0.5)
        write_config(key, data)

    ctx.backend.replace = replace  # type: ignore[method-assign]
    predicted = threading.Thread(target=UPGRADES_TO_PREDICTED[upgrade], args=(ctx,))
    predicted.start()
    assert slow.wait(timeout=10)
    packs = threading.Thread(target=lambda: (ctx.allow_packs(), packs_done.set()))
    packs.start()
    predicted.join()
    packs.join()
    assert ctx.config.version == PACKS_VERSION
    assert json.loads((tmp_path / "repo" / "config.json").read_text())["version"] == PACKS_VERSION


def test_an_upgrade_never_lowers_and_skips_version_one(tmp_path: Path) -> None:
    Repo.init(tmp_path / "repo")
    ctx = open_context(tmp_path / "repo")
    assert ctx.upgrade(PACKS_VERSION) and ctx.config.version == PACKS_VERSION
    assert ctx.upgrade(PREDICTED_VERSION) and ctx.config.version == PACKS_VERSION
    config = tmp_path / "repo" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "version": 1}))
    old = open_context(tmp_path / "repo")
    assert not old.upgrade(PREDICTED_VERSION) and json.loads(config.read_text())["version"] == 1

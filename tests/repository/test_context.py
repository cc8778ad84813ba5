"""Repository format upgrades (RepoContext.upgrade, docs/format.md compatibility): whatever raises
the version (compaction's predicted deltas, a fetch landing them, a local pack) goes through one
lock, so two upgrades racing never leave the repository at the lower version; every change of the
settings is made to config.json as it is on disk, whichever processes change it at once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from ckstore.codecs.objects import Encoding
from ckstore.compaction.pairing import Upgrade
from ckstore.format.settings import CONFIG_KEY, CONTEXT_VERSION, PACKS_VERSION, PREDICTED_VERSION
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


# ---- settings written by several processes ---------------------------------------------------

# A process that opened the repository before the others changed anything (a training script, a
# detached compaction waiting its turn), then, once told to go, changes one setting many times.
_CHANGER = """
import sys, time
from dataclasses import replace
from pathlib import Path
from ckstore.repository.context import open_context
repo, key, first, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
ctx = open_context(repo)
print("open", flush=True)
while not go.exists():
    time.sleep(0.005)
for value in range(first, first + count):
    if key == "version":
        ctx.upgrade(value)
    else:
        ctx.set_config(replace(ctx.config, **{key: value}))
"""


def test_processes_changing_settings_at_once_lose_no_change_and_never_lower_the_version(tmp_path: Path) -> None:
    Repo.init(tmp_path / "repo")
    go = tmp_path / "go"
    plan = {"reflog_expire_days": (100, 40), "reflog_expire_unreachable_days": (200, 40), "version": (3, 4)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHANGER, str(tmp_path / "repo"), key, str(first), str(count), str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for key, (first, count) in plan.items()
    ]
    for proc in procs:  # every process holds its copy of the settings (version 2) before any change
        assert proc.stdout is not None and proc.stdout.readline() == "open\n"
    go.touch()
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    on_disk = json.loads((tmp_path / "repo" / "config.json").read_text())
    assert {key: on_disk[key] for key in plan} == {key: first + count - 1 for key, (first, count) in plan.items()}


def test_a_repository_opened_earlier_neither_lowers_the_version_nor_reverts_a_setting(tmp_path: Path) -> None:
    path = tmp_path / "repo"
    stale = Repo.init(path, chunk_size=4096)  # a training script's handle: version 2, default settings
    ck = [sys.executable, "-m", "ckstore.cli", "--repo", str(path)]
    subprocess.run([*ck, "config", "reflog_expire_days", "3650"], check=True, capture_output=True, timeout=120)
    ctx = open_context(path)
    ctx.upgrade(CONTEXT_VERSION)  # as a repack in another shell does before writing context-sorted deltas
    stale.set_config(replace(stale.config, zstd_level=3))
    assert stale._ctx.upgrade(PACKS_VERSION)  # the stale handle's next commit goes into a pack
    on_disk = json.loads((path / "config.json").read_text())
    assert (on_disk["version"], on_disk["reflog_expire_days"], on_disk["zstd_level"]) == (CONTEXT_VERSION, 3650, 3)
    assert stale.config.version == CONTEXT_VERSION and stale.config.reflog_expire_days == 3650

"""Delta bases are found by tensor identity, not file path (positions.ChunkIndex)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckstore import Repo
from ckstore.format.ids import ObjectId
from ckstore.format.manifest import ChunkRef, FileEntry, TensorEntry
from ckstore.format.positions import HEADER, ChunkIndex

CHUNK = 4096


def _weights(epochs: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A training run: every weight moves by a few ulps each epoch, as fine-tuning does."""
    rng = np.random.default_rng(seed)
    state = {f"layer{i}.weight": rng.standard_normal((48, 64)).astype(np.float32) * 0.05 for i in range(4)}
    out = []
    for _ in range(epochs):
        state = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 1e-5 for k, v in state.items()}
        out.append(dict(state))
    return out


def _stored(repo: Repo) -> int:
    return sum(repo.store.stored_size(o) or 0 for o in repo.store.iter_ids())


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _commit_each(repo: Repo, files: list[Path]) -> list[str]:
    """One commit a file, then the compactions after them waited for (sizes are compared)."""
    ids = [repo.commit([f], message=f.name) for f in files]
    repo.wait()
    return ids


def test_epoch_named_files_get_deltas_like_files_under_one_name(tmp_path: Path) -> None:
    epochs = _weights(4)
    named, same = [], []
    for e, tensors in enumerate(epochs):
        (tmp_path / "named").mkdir(exist_ok=True)
        save_file(tensors, str(tmp_path / "named" / f"epoch_{e}.safetensors"))
        (tmp_path / f"same{e}").mkdir()
        save_file(tensors, str(tmp_path / f"same{e}" / "model.safetensors"))
        named.append(tmp_path / "named" / f"epoch_{e}.safetensors")
        same.append(tmp_path / f"same{e}" / "model.safetensors")
    by_name = Repo.init(tmp_path / "a", chunk_size=CHUNK)
    by_path = Repo.init(tmp_path / "b", chunk_size=CHUNK)
    ids = _commit_each(by_name, named)
    _commit_each(by_path, same)
    # The same deltas whatever the files are called: within 2 % of the one-name layout, and far
    # below four whole copies.
    assert _stored(by_name) <= 1.02 * _stored(by_path)
    whole = Repo.init(tmp_path / "c", chunk_size=CHUNK, max_delta_depth=0)
    _commit_each(whole, named)
    assert _stored(by_name) < 0.75 * _stored(whole)
    older = by_name.read_commit(ids[0])
    assert any(by_name.store.bases_of(c.id) != () for t in older.files[0].tensors for c in t.chunks)
    for oid, f in zip(ids, named):
        out = tmp_path / f"out-{oid[:8]}"
        by_name.checkout(oid, out)
        assert _sha(out / f.name) == _sha(f)
    assert by_name.fsck(read_data=True) == []


def test_a_folder_of_all_epochs_pairs_the_new_file_with_the_newest_old_one(tmp_path: Path) -> None:
    """Committing ckpt/ after each epoch (it holds every epoch so far): the new file's base is
    the previous epoch's file, not epoch_1 (natural order: epoch_10 follows epoch_9)."""
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for e, tensors in enumerate(_weights(11)):
        save_file(tensors, str(folder / f"epoch_{e}.safetensors"))
        repo.commit([folder], message=f"epoch {e}")
    head = repo.read_commit(repo.resolve("HEAD"))
    index = ChunkIndex(
        repo.read_commit(repo.resolve("HEAD~1")).files, {f.path: [t.name for t in f.tensors] for f in head.files}
    )
    chosen = index[("epoch_10.safetensors", "layer0.weight")]
    epoch9 = next(f for f in head.files if f.path == "epoch_9.safetensors")
    assert chosen == epoch9.tensors[0].chunks


def test_moved_files_and_shifting_shards_still_pair_by_tensor_name(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    epochs = _weights(3)
    names = sorted(epochs[0])
    layouts = [  # epoch 0: two shards; epoch 1: moved into a folder; epoch 2: tensors move shards
        {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]},
        {"sub/model-00001-of-00002.safetensors": names[:2], "sub/model-00002-of-00002.safetensors": names[2:]},
        {"sub/model-00001-of-00002.safetensors": names[:3], "sub/model-00002-of-00002.safetensors": names[3:]},
    ]
    ids = []
    for e, layout in enumerate(layouts):
        folder = tmp_path / f"e{e}"
        for path, keys in layout.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            save_file({k: epochs[e][k] for k in keys}, str(folder / path))
        ids.append(repo.commit([folder], message=f"epoch {e}"))
    repo.wait()  # compaction after each commit re-encodes the parent
    # Every chunk of the older commits became a delta against the newer commit's same tensor.
    for oid in ids[:2]:
        chunks = [c for f in repo.read_commit(oid).files for t in f.tensors for c in t.chunks]
        assert sum(repo.store.bases_of(c.id) != () for c in chunks) >= len(chunks) * 0.9
    for e, oid in enumerate(ids):
        out = tmp_path / f"out{e}"
        repo.checkout(oid, out)
        for path in layouts[e]:
            assert _sha(out / path) == _sha(tmp_path / f"e{e}" / path)
    assert repo.fsck(read_data=True) == []


def _file(path: str, *names: str) -> FileEntry:
    tensors = tuple(
        TensorEntry(n, "F32", (1,), (ChunkRef(ObjectId(f"{abs(hash((path, n))):064x}"[-64:]), 4),)) for n in names
    )
    return FileEntry(path, "safetensors", 8 + 4 * len(names), header=(), tensors=tensors)


@pytest.mark.parametrize(
    "holders, new_files, expected",
    [
        (["a.safetensors"], {"b.safetensors": ["w"]}, "a.safetensors"),
        # a file the new commit no longer has wins over one it still holds
        (
            ["gone.safetensors", "kept.safetensors"],
            {"kept.safetensors": ["w"], "new.safetensors": ["w"]},
            "gone.safetensors",
        ),
        # natural order: step_100 after step_99
        (
            ["step_99.safetensors", "step_100.safetensors"],
            {"step_99.safetensors": ["w"], "step_100.safetensors": ["w"], "new.safetensors": ["w"]},
            "step_100.safetensors",
        ),
    ],
)
def test_chunk_index_choice(holders: list[str], new_files: dict[str, list[str]], expected: str) -> None:
    index = ChunkIndex([_file(h, "w") for h in holders], new_files)
    assert index[("new.safetensors", "w")] == _file(expected, "w").tensors[0].chunks
    with pytest.raises(KeyError):
        index[("new.safetensors", HEADER)]
    with pytest.raises(KeyError):
        index[("new.safetensors", "missing")]

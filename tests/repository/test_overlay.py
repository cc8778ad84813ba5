"""Overlays (issue 6, point 1): commits recorded on a base commit in this or another repository.

The oracle for every checkout is the fine-tuned folder itself (sha256 per file); the oracle for the
relative L2 norm is torch on the whole tensors. Storage claims are checked on the objects
themselves: which repository holds them (``has_local``) and what a delta's bases are (``bases_of``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

from ckstore.cli import main
from ckstore.codecs.objects import Kind
from ckstore.errors import BaseUnreachableError, DependentNotFoundError, IntegrityError, InvalidInputError
from ckstore.format.manifest import BaseRef
from ckstore.repo import Repo
from ckstore.repository.links import ALTERNATES_KEY, DEPENDENTS_KEY, read_paths
from tests.helpers import save_st, tree_digest

CHUNK = 4096  # small chunks, so every tensor below spans several and deltas are per chunk
N = 8192  # float32 elements per big tensor: 32 KiB, 8 chunks


def base_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(N, generator=g),  # frozen during the fine-tune
        "layer.weight": torch.randn(64, N // 64, generator=g),  # tuned
        "layer.bias": torch.randn(64, generator=g),  # tuned, smaller than a chunk
        "norm.weight": torch.randn(N, generator=g).to(torch.bfloat16),  # tuned, bf16
        "pooler.weight": torch.randn(N, generator=g),  # dropped by the fine-tune
    }


def fine_tune(tensors: Mapping[str, torch.Tensor], seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """What a short fine-tune does: small updates to some tensors, one dropped, a new head."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = dict(tensors)
    out["layer.weight"] = tensors["layer.weight"] + scale * torch.randn(tensors["layer.weight"].shape, generator=g)
    out["layer.bias"] = tensors["layer.bias"] + scale * torch.randn(64, generator=g)
    out["norm.weight"] = (tensors["norm.weight"].float() * (1 + 0.05 * torch.randn(N, generator=g))).to(torch.bfloat16)
    out.pop("pooler.weight", None)
    out[f"head{seed}.weight"] = torch.randn(3, 128, generator=g)
    return out


def write_folder(root: Path, tensors: Mapping[str, torch.Tensor], config: dict[str, object]) -> Path:
    save_st(root / "model.safetensors", tensors, metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text(json.dumps({"vocab": {f"t{i}": i for i in range(300)}}))
    return root


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    base = base_tensors()
    tuned = fine_tune(base, 1)
    return (
        write_folder(tmp_path / "pretrained", base, {"n": 1}),
        write_folder(tmp_path / "finetuned", tuned, {"n": 1, "labels": 3}),
        base,
        tuned,
    )


def stored_bytes(repo: Repo) -> int:
    return sum(repo.store.stored_size(o) or 0 for o in repo.store.iter_ids())


def tensor_chunks(repo: Repo, ref: str, name: str) -> list[str]:
    commit = repo.read_commit(repo.resolve(ref))
    return [c.id for f in commit.files for t in f.tensors if t.name == name for c in t.chunks]


def torch_rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float(torch.linalg.vector_norm(b64 - a64) / torch.linalg.vector_norm(a64))


def assert_checkout_equals(repo: Repo, ref: str, folder: Path, out: Path) -> None:
    repo.checkout(ref, out)
    assert tree_digest(out) == tree_digest(folder)


def assert_overlay_storage(overlay: Repo, base: Repo, base_ref: str, ref: str) -> None:
    """Identical tensors reuse the base's chunks; changed ones are deltas of the base's chunk at
    the same position; the added head is stored whole, here."""
    same_repo = overlay.path == base.path
    for name in ("embed.weight",):
        assert tensor_chunks(overlay, ref, name) == tensor_chunks(base, base_ref, name)
        assert all(base.store.has_local(c) for c in tensor_chunks(overlay, ref, name))
        if not same_repo:
            assert not any(overlay.store.has_local(c) for c in tensor_chunks(overlay, ref, name))
    for name in ("layer.weight", "norm.weight"):
        mine, theirs = tensor_chunks(overlay, ref, name), tensor_chunks(base, base_ref, name)
        assert len(mine) == len(theirs) > 1 and not set(mine) & set(theirs)
        assert all(overlay.store.has_local(c) for c in mine)
        assert [overlay.store.bases_of(c) for c in mine] == [(t,) for t in theirs]
    head = [n for n in _names(overlay, ref) if n.startswith("head")]
    assert head and all(
        overlay.store.bases_of(c) == () and overlay.store.has_local(c)
        for n in head
        for c in tensor_chunks(overlay, ref, n)
    )


def _names(repo: Repo, ref: str) -> list[str]:
    return [t.name for f in repo.read_commit(repo.resolve(ref)).files for t in f.tensors]


# ---- one repository, another branch ------------------------------------------------------------


def test_overlay_on_another_branch(tmp_path: Path, folders: tuple[Path, Path, dict, dict]) -> None:
    pretrained, finetuned, _, _ = folders
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    base_id = repo.commit(pretrained, message="pretrained")
    repo.wait()
    before = stored_bytes(repo)
    cid = repo.commit(finetuned, branch="ft", base="main", message="fine-tune")
    commit = repo.read_commit(cid)
    assert commit.base == BaseRef(base_id, None)
    assert read_paths(repo.backend, ALTERNATES_KEY) == [] and read_paths(repo.backend, DEPENDENTS_KEY) == []
    assert_overlay_storage(repo, repo, "main", cid)
    # The overlay added deltas for the tuned tensors and the new head: far less than the base.
    assert stored_bytes(repo) - before < before / 3
    assert_checkout_equals(repo, "ft", finetuned, tmp_path / "out")
    assert repo.fsck(read_data=True) == []


def test_overlay_inherits_base_files_it_does_not_replace(
    tmp_path: Path, folders: tuple[Path, Path, dict, dict]
) -> None:
    pretrained, finetuned, _, _ = folders
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    repo.commit(pretrained)
    cid = repo.commit(finetuned / "model.safetensors", branch="ft", base="main")
    repo.checkout(cid, tmp_path / "out")
    expected = tree_digest(pretrained) | {"model.safetensors": tree_digest(finetuned)["model.safetensors"]}
    assert tree_digest(tmp_path / "out") == expected
    assert repo.from_base(cid) >= {("config.json", None), ("tokenizer.json", None)}


def test_commit_state_with_base(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    state = {"model": base_tensors(), "step": 1}
    base_id = repo.commit_state(state, message="pretrained")
    tuned = {"model": fine_tune(state["model"], 2), "step": 2}
    cid = repo.commit_state(tuned, branch="ft", base=base_id)
    assert repo.read_commit(cid).base == BaseRef(base_id, None)
    loaded = repo.load_state(cid)
    assert loaded["step"] == 2 and loaded["model"].keys() == tuned["model"].keys()
    assert all(torch.equal(loaded["model"][k], v) for k, v in tuned["model"].items())
    inherited = {name for _, name in repo.from_base(cid)}
    assert "model.embed.weight" in inherited and "model.layer.weight" not in inherited
    changed = tensor_chunks(repo, cid, "model.layer.weight")
    assert [repo.store.bases_of(c) for c in changed] == [
        (b,) for b in tensor_chunks(repo, base_id, "model.layer.weight")
    ]


# ---- a base in another repository ---------------------------------------------------------------


def test_overlay_on_a_base_in_another_repository(tmp_path: Path, folders: tuple[Path, Path, dict, dict]) -> None:
    pretrained, finetuned, base_t, tuned_t = folders
    base = Repo.init(tmp_path / "base", chunk_size=CHUNK)
    base_id = base.commit(pretrained, message="pretrained", branch="pretrained")
    base.wait()
    base_objects = set(base.store.iter_ids())
    overlay = Repo.init(tmp_path / "overlay", chunk_size=CHUNK)
    cid = overlay.commit(finetuned, base="pretrained", base_repo=tmp_path / "base")

    assert set(base.store.iter_ids()) == base_objects  # nothing written into the base repository
    assert overlay.read_commit(cid).base == BaseRef(base_id, str((tmp_path / "base").resolve()))
    assert read_paths(overlay.backend, ALTERNATES_KEY) == ["../base"]  # relative: tests/repository/test_links.py
    assert read_paths(base.backend, DEPENDENTS_KEY) == ["../overlay"]
    # Referenced, not copied: the overlay repository holds deltas and the head only.
    assert stored_bytes(overlay) < stored_bytes(base) / 3
    assert not base.store.has_local(cid) and not overlay.store.has_local(base_id)

    reopened = Repo(tmp_path / "overlay")  # alternates are found again from disk
    assert_overlay_storage(reopened, base, base_id, cid)
    assert_checkout_equals(reopened, cid, finetuned, tmp_path / "out")
    assert reopened.fsck(read_data=True) == [] and base.fsck(read_data=True) == []

    # diff BASE OVERLAY, with BASE named by a ref of the base repository (refs of the overlay
    # repository come first: its own "main" is the overlay).
    assert reopened.resolve("main") == cid
    changes = {c.name or c.path: c for c in reopened.diff("pretrained", cid)}
    assert {k: c.status for k, c in changes.items()} == {
        "embed.weight": "unchanged",
        "layer.weight": "changed",
        "layer.bias": "changed",
        "norm.weight": "changed",
        "pooler.weight": "removed",
        "head1.weight": "added",
        "config.json": "changed",
        "tokenizer.json": "unchanged",
    }
    for name in ("layer.weight", "layer.bias", "norm.weight"):
        c = changes[name]
        assert c.rel_l2 == pytest.approx(torch_rel_l2(base_t[name], tuned_t[name]), rel=1e-6)
        raw = tuned_t[name].numel() * tuned_t[name].element_size()
        assert (
            0
            < c.stored_bytes
            == sum(reopened.store.stored_size(o) or 0 for o in set(tensor_chunks(reopened, cid, name)))
        )
        if name != "layer.bias":  # a 256-byte tensor costs its object header; big ones compress
            assert c.stored_bytes < raw
    assert changes["embed.weight"].stored_bytes == 0 and changes["embed.weight"].rel_l2 is None
    assert changes["head1.weight"].stored_bytes > 0 and changes["pooler.weight"].stored_bytes == 0
    assert "pooler.weight" not in load_file(tmp_path / "out" / "model.safetensors")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_relative_l2_matches_torch(tmp_path: Path, dtype: torch.dtype) -> None:
    """Chunk-by-chunk relative L2 (chunks that split elements, 3-byte-odd sizes) against torch."""
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(10_007, generator=g) * 50).to(dtype)
    b = (a.double() + torch.randn(10_007, generator=g, dtype=torch.float64)).to(dtype)
    save_st(tmp_path / "a" / "t.safetensors", {"x": a, "zero": torch.zeros(5, dtype=dtype)})
    save_st(tmp_path / "b" / "t.safetensors", {"x": b, "zero": torch.ones(5, dtype=dtype)})
    ia = repo.commit(tmp_path / "a")
    ib = repo.commit(tmp_path / "b", base=ia)
    changes = {c.name: c for c in repo.diff(ia, ib)}
    assert changes["x"].rel_l2 == pytest.approx(torch_rel_l2(a, b), rel=1e-6)
    assert changes["zero"].rel_l2 == float("inf")  # a change from an all-zero tensor


def test_show_and_diff_cli(tmp_path: Path, folders: tuple[Path, Path, dict, dict]) -> None:
    pretrained, finetuned, base_t, tuned_t = folders
    run = CliRunner()

    def cli(*args: str, code: int = 0) -> Result:
        result = run.invoke(main, list(args))
        assert result.exit_code == code, result.output
        return result

    cli("init", str(tmp_path / "base"))
    cli("init", str(tmp_path / "overlay"))
    base_id = cli("--repo", str(tmp_path / "base"), "commit", str(pretrained), "-m", "pretrained").output.strip()
    oid = cli(
        "--repo", str(tmp_path / "overlay"), "commit", str(finetuned), "--base-repo", str(tmp_path / "base")
    ).output.strip()  # --base defaults to the base's HEAD
    repo = ["--repo", str(tmp_path / "overlay")]
    doc = json.loads(cli(*repo, "show", oid, "--json").output)
    assert doc["base"] == {"commit": base_id, "repo": str((tmp_path / "base").resolve())}
    files = {f["path"]: f for f in doc["files"]}
    assert files["tokenizer.json"]["from_base"] and not files["config.json"]["from_base"]
    marks = {t["name"]: t["from_base"] for t in files["model.safetensors"]["tensors"]}
    assert marks == {
        "embed.weight": True,
        "layer.weight": False,
        "layer.bias": False,
        "norm.weight": False,
        "head1.weight": False,
    }
    text = cli(*repo, "show", oid, "--tensors").output
    assert f"Base:   {base_id}" in text
    assert "1 of 5 tensors from base" in cli(*repo, "show", oid).output
    assert [line for line in text.splitlines() if "(from base)" in line] == [
        line for line in text.splitlines() if "embed.weight" in line
    ]

    out = cli(*repo, "diff", base_id[:10], oid).output
    assert f"relative L2 change {torch_rel_l2(base_t['layer.weight'], tuned_t['layer.weight']):.3g}" in out
    assert "- model.safetensors:pooler.weight" in out and "+ model.safetensors:head1.weight" in out
    assert "embed.weight" not in out
    as_json = {
        (c["path"], c["name"]): c for c in json.loads(cli(*repo, "diff", base_id, oid, "--json").output)["changes"]
    }
    assert as_json[("model.safetensors", "norm.weight")]["rel_l2"] == pytest.approx(
        torch_rel_l2(base_t["norm.weight"], tuned_t["norm.weight"]), rel=1e-6
    )

    # --base within one repository, by branch name.
    cli("--repo", str(tmp_path / "base"), "branch", "pre")
    own = cli(
        "--repo", str(tmp_path / "base"), "commit", str(finetuned), "--branch", "ft", "--base", "pre"
    ).output.strip()
    assert json.loads(cli("--repo", str(tmp_path / "base"), "show", own, "--json").output)["base"] == {
        "commit": base_id,
        "repo": None,
    }
    cli("--repo", str(tmp_path / "base"), "checkout", own, "-o", str(tmp_path / "own"))
    assert tree_digest(tmp_path / "own") == tree_digest(finetuned)
    # Bad bases: one line, documented exit code, nothing recorded.
    bad = cli(*repo, "commit", str(finetuned), "--base-repo", str(tmp_path / "nowhere"), code=3)
    assert bad.output.count("\n") == 1 and bad.output.startswith("ckstore: ")
    bad = cli(*repo, "commit", str(finetuned), "--base", "no-such-branch", code=3)
    assert bad.output.count("\n") == 1
    assert [e["id"] for e in json.loads(cli(*repo, "log", "--json").output)] == [oid]


# ---- stacking -----------------------------------------------------------------------------------


def _three_generations(tmp_path: Path) -> list[Path]:
    t0 = base_tensors()
    t1 = fine_tune(t0, 1)
    t2 = fine_tune(t1, 2)
    t3 = fine_tune(t2, 3)
    return [write_folder(tmp_path / f"gen{i}", t, {"gen": i}) for i, t in enumerate((t0, t1, t2, t3))]


def test_overlay_three_levels_deep_across_repositories(tmp_path: Path) -> None:
    gens = _three_generations(tmp_path)
    repos = [Repo.init(tmp_path / f"r{i}", chunk_size=CHUNK) for i in range(4)]
    ids = [repos[0].commit(gens[0])]
    for i in (1, 2, 3):
        ids.append(repos[i].commit(gens[i], base=ids[i - 1], base_repo=tmp_path / f"r{i - 1}"))
    top = Repo(tmp_path / "r3")  # opens r2, which opens r1, which opens r0
    assert_checkout_equals(top, ids[3], gens[3], tmp_path / "out3")
    # The frozen tensor is stored once, in r0, and every level references it.
    frozen = tensor_chunks(top, ids[3], "embed.weight")
    assert frozen == tensor_chunks(repos[0], ids[0], "embed.weight")
    assert [sum(r.store.has_local(c) for c in frozen) for r in repos] == [len(frozen), 0, 0, 0]
    # Each level's changed tensor is a delta of the level below, whose object lives below.
    mine, below = tensor_chunks(top, ids[3], "layer.weight"), tensor_chunks(top, ids[2], "layer.weight")
    assert [top.store.bases_of(c) for c in mine] == [(b,) for b in below] and all(
        repos[2].store.has_local(c) for c in below
    )
    # The second head was added at level 2 and inherited unchanged by level 3.
    assert ("model.safetensors", "head2.weight") in top.from_base(ids[3])
    changes = {c.name: c.status for c in top.diff(ids[2], ids[3]) if c.name}
    assert changes["head2.weight"] == "unchanged" and changes["head3.weight"] == "added"
    for i, r in enumerate(repos):
        assert Repo(r.path).fsck(read_data=True) == [], i
    # A repository three levels down may be named by its refs from the top.
    assert top.resolve("main") == ids[3] and top.resolve(ids[0][:12]) == ids[0]


def test_overlay_three_levels_deep_in_one_repository(tmp_path: Path) -> None:
    gens = _three_generations(tmp_path)
    repo = Repo.init(tmp_path / "repo", chunk_size=CHUNK)
    ids = [repo.commit(gens[0], branch="g0")]
    for i in (1, 2, 3):
        ids.append(repo.commit(gens[i], branch=f"g{i}", base=f"g{i - 1}"))
    for i in range(4):
        assert_checkout_equals(repo, f"g{i}", gens[i], tmp_path / f"out{i}")
    assert repo.read_commit(ids[3]).base == BaseRef(ids[2], None)
    chunks = tensor_chunks(repo, ids[3], "layer.weight")
    depth = repo.store.chain_depth(chunks[0])
    assert 1 <= depth <= repo.config.max_delta_depth


# ---- gc and fsck with overlays in both repositories ------------------------------------------------


def test_gc_with_overlays_in_both_repositories(tmp_path: Path) -> None:
    """The base repository B has its own in-repo overlay; the overlay repository O has a base in B
    and an overlay on that overlay. gc in B (plain, --keep-last 1, after deleting the base branch)
    must keep what O needs; gc in O must never touch B."""
    gens = _three_generations(tmp_path)
    b = Repo.init(tmp_path / "B", chunk_size=CHUNK)
    b_base = b.commit(gens[0], branch="pretrained")
    b.commit(gens[1], branch="b-ft", base="pretrained")  # B's own overlay
    o = Repo.init(tmp_path / "O", chunk_size=CHUNK)
    o1 = o.commit(gens[1], branch="ft1", base="pretrained", base_repo=tmp_path / "B")
    o2 = o.commit(gens[2], branch="ft2", base="ft1")  # overlay on the overlay, within O
    o3 = o.commit(gens[3], branch="ft3", base="pretrained", base_repo=tmp_path / "B")
    # gens[1] was committed in B first, so O's first overlay references B's objects even for
    # its changed tensors: B's gc must keep them although no ref of B reaches them.
    assert not any(o.store.has_local(c) for c in tensor_chunks(o, o1, "layer.weight"))
    # B moves on: new commits on main, then its pretrained and b-ft branches go.
    for seed in (7, 8, 9):
        b.commit(write_folder(tmp_path / f"b{seed}", base_tensors(seed), {"seed": seed}), branch="main")
    b.delete_branch("pretrained", force=True)  # the current branch
    b.delete_branch("b-ft")
    b_objects = set(b.store.iter_ids())
    for kwargs in ({"prune_now": True}, {"keep_last": 1, "prune_now": True}):
        report = b.gc(**kwargs)  # type: ignore[arg-type]
        assert report.deleted_objects > 0  # b-ft's commit, then the older main commits
        assert b.store.has_local(b_base)  # O still needs it
    # In O, delete the branch of the first overlay: the second still needs it as its base.
    o.delete_branch("ft1", force=True)
    b_after = set(Repo(tmp_path / "B").store.iter_ids())
    for kwargs in ({"prune_now": True}, {"keep_last": 1, "prune_now": True}):
        Repo(tmp_path / "O").gc(**kwargs)  # type: ignore[arg-type]
        assert set(Repo(tmp_path / "B").store.iter_ids()) == b_after  # never touched B
    o = Repo(tmp_path / "O")
    assert all(o.store.has_local(c) for c in (o1, o2, o3))
    for cid, gen in ((o1, 1), (o2, 2), (o3, 3)):
        assert_checkout_equals(o, cid, gens[gen], tmp_path / f"o{gen}")
    b = Repo(tmp_path / "B")
    assert o.fsck(read_data=True) == [] and b.fsck(read_data=True) == []
    assert b_objects > b_after


def test_gc_in_base_keeps_delta_bases_of_overlays_pruned_history(tmp_path: Path) -> None:
    """O's tip is a plain commit whose tensors are deltas of an overlay commit that O's own gc has
    pruned, and those are deltas of the base's chunks in B: B's gc must follow that chain."""
    gens = _three_generations(tmp_path)
    b = Repo.init(tmp_path / "B", chunk_size=CHUNK)
    b.commit(gens[0], branch="pretrained")
    o = Repo.init(tmp_path / "O", chunk_size=CHUNK)
    o.commit(gens[1], base="pretrained", base_repo=tmp_path / "B")
    tip = o.commit(gens[2])  # an ordinary next epoch on the same branch: deltas of the overlay
    o.gc(keep_last=1)
    assert len(o.log()) == 1
    b.delete_branch("pretrained", force=True)
    b.commit(gens[3], branch="main")
    b.gc(keep_last=1, prune_now=True)
    o = Repo(tmp_path / "O")
    assert o.fsck(read_data=True) == []
    assert_checkout_equals(o, tip, gens[2], tmp_path / "out")


def test_gc_dry_run_in_base_reports_nothing_the_overlay_needs(
    tmp_path: Path, folders: tuple[Path, Path, dict, dict]
) -> None:
    pretrained, finetuned, _, _ = folders
    b = Repo.init(tmp_path / "B", chunk_size=CHUNK)
    b.commit(pretrained, branch="pretrained")
    o = Repo.init(tmp_path / "O", chunk_size=CHUNK)
    o.commit(finetuned, base="pretrained", base_repo=tmp_path / "B")
    b.delete_branch("pretrained", force=True)
    assert b.gc(dry_run=True, prune_now=True).deleted_objects == 0
    # Once the overlay repository is deleted (and forgotten: gc refuses until then, as it may only
    # have moved), its needs go with it.
    shutil.rmtree(tmp_path / "O")
    with pytest.raises(DependentNotFoundError):
        b.gc(prune_now=True, force=True)
    b.relink(prune=True)
    assert b.gc(prune_now=True, force=True).deleted_objects > 0
    assert list(Repo(tmp_path / "B").store.iter_ids()) == []  # B has no refs left


def test_fsck_reports_an_unreachable_base_repository(tmp_path: Path, folders: tuple[Path, Path, dict, dict]) -> None:
    pretrained, finetuned, _, _ = folders
    Repo.init(tmp_path / "B", chunk_size=CHUNK).commit(pretrained)
    o = Repo.init(tmp_path / "O", chunk_size=CHUNK)
    o.commit(finetuned, base_repo=tmp_path / "B", base="HEAD")
    shutil.move(tmp_path / "B", tmp_path / "B-moved")
    problems = Repo(tmp_path / "O").fsck()
    where = str((tmp_path / "B").resolve())
    # One line for the base (newcomer review item 8), not one per object it holds: those are
    # counted on it, and the result is "not found", not "corrupt data".
    assert len(problems) == 1 and problems.only_unreachable_bases, problems
    assert problems[0].startswith("base repository unreachable: ") and where in problems[0]
    assert "relink NEW_LOCATION" in problems[0] and "object(s) this repository uses are not here" in problems[0]
    run = CliRunner().invoke(main, ["--repo", str(tmp_path / "O"), "fsck"])
    assert run.exit_code == BaseUnreachableError.exit_code == 3, run.output
    assert run.output.splitlines() == [problems[0], "ckstore: 1 problem(s) found: base repository unreachable"]
    run = CliRunner().invoke(main, ["--repo", str(tmp_path / "O"), "fsck", "--json"])
    assert run.exit_code == 3 and json.loads(run.stdout)["unreachable_bases"] == 1
    # Moved back, everything is whole again.
    shutil.move(tmp_path / "B-moved", tmp_path / "B")
    assert Repo(tmp_path / "O").fsck(read_data=True) == []
    # An object of the overlay's own lost while the base is away cannot be told from the base's:
    # it is counted on the base's line; once the base is back it is named, and the data is corrupt.
    own = next(
        oid
        for oid in o.store.iter_ids()
        if oid not in set(Repo(tmp_path / "B").store.iter_ids()) and o.store.kind(oid) == Kind.CHUNK
    )
    o.store.delete(own)
    shutil.move(tmp_path / "B", tmp_path / "B-moved")
    again = Repo(tmp_path / "O").fsck()
    assert len(again) == 1 and again.only_unreachable_bases
    shutil.move(tmp_path / "B-moved", tmp_path / "B")
    run = CliRunner().invoke(main, ["--repo", str(tmp_path / "O"), "fsck"])
    assert run.exit_code == IntegrityError.exit_code and f"object {own} is missing" in run.output, run.output


def test_fsck_reports_a_missing_base_commit(tmp_path: Path, folders: tuple[Path, Path, dict, dict]) -> None:
    pretrained, finetuned, _, _ = folders
    b = Repo.init(tmp_path / "B", chunk_size=CHUNK)
    base_id = b.commit(pretrained)
    o = Repo.init(tmp_path / "O", chunk_size=CHUNK)
    o.commit(finetuned, base_repo=tmp_path / "B", base="HEAD")
    b.store.delete(base_id)  # damage: the base commit object is gone
    problems = Repo(tmp_path / "O").fsck()
    assert any(f"base commit {base_id} in {(tmp_path / 'B').resolve()} is unreachable" in p for p in problems)
    # Within one repository, a missing base commit is named too.
    r = Repo.init(tmp_path / "R", chunk_size=CHUNK)
    rb = r.commit(pretrained, branch="pre")
    r.commit(finetuned, branch="ft", base="pre")
    r.delete_branch("pre", force=True)
    r.store.delete(rb)
    assert any(rb in p and "overlay commit" in p for p in r.fsck())  # r read rb before: no cached copy


def test_a_cycle_of_base_repositories_is_refused(tmp_path: Path, folders: tuple[Path, Path, dict, dict]) -> None:
    pretrained, finetuned, _, _ = folders
    a = Repo.init(tmp_path / "A", chunk_size=CHUNK)
    a.commit(pretrained)
    b = Repo.init(tmp_path / "B", chunk_size=CHUNK)
    b.commit(finetuned, base_repo=tmp_path / "A", base="HEAD")
    with pytest.raises(InvalidInputError, match="cycle"):
        a.commit(finetuned, base_repo=tmp_path / "B", base="HEAD")
    assert read_paths(a.backend, ALTERNATES_KEY) == [] and len(a.log()) == 1
    # Longer cycles too: C on B, then A on C.
    c = Repo.init(tmp_path / "C", chunk_size=CHUNK)
    c.commit(finetuned, base_repo=tmp_path / "B", base="HEAD")
    result = CliRunner().invoke(
        main, ["--repo", str(tmp_path / "A"), "commit", str(finetuned), "--base-repo", str(tmp_path / "C")]
    )
    assert result.exit_code == InvalidInputError.exit_code and "cycle" in result.output
    assert result.output.count("\n") == 1

"""Overlays survive a move (issue 10, point 2).

Repositories record each other by a path relative to themselves when they share a folder, so a
project folder moved as a whole keeps every link; when only one of them moves, fsck, checkout and
gc name ``ckstore relink``, and running it repairs both sides. The oracle for every checkout is
the committed folder itself (sha256 per file); gc is checked by what is still on disk afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st

from ckstore.cli import main
from ckstore.errors import DependentNotFoundError, InvalidInputError, NotFoundError, ObjectMissingError
from ckstore.repo import Repo
from ckstore.repository.links import (
    ALTERNATES_KEY,
    DEPENDENTS_KEY,
    LOCATION_KEY,
    link_entry,
    read_links,
    read_paths,
    resolve_entry,
)
from tests.helpers import tree_digest
from tests.repository.test_overlay import CHUNK, base_tensors, fine_tune, write_folder


def cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def data(tmp_path: Path) -> dict[str, Path]:
    """Three generations of a model, outside every repository (the checkout oracle)."""
    base = base_tensors()
    tuned = fine_tune(base, 1)
    return {
        "pretrained": write_folder(tmp_path / "data" / "pretrained", base, {"n": 1}),
        "ft": write_folder(tmp_path / "data" / "ft", tuned, {"n": 1, "labels": 3}),
        "ft2": write_folder(tmp_path / "data" / "ft2", fine_tune(tuned, 2), {"n": 2}),
    }


def make_project(root: Path, data: dict[str, Path], stacked: bool = False) -> dict[str, str]:
    """project/base holds the pretrained model; project/ft an overlay on it in its own repository
    (and project/ft2 an overlay on that one). Returns the commit ids by repository name."""
    base = Repo.init(root / "base", chunk_size=CHUNK)
    ids = {"base": base.commit(data["pretrained"], branch="pretrained")}
    ft = Repo.init(root / "ft", chunk_size=CHUNK)
    ids["ft"] = ft.commit(data["ft"], base="pretrained", base_repo=root / "base")
    if stacked:
        ids["ft2"] = Repo.init(root / "ft2", chunk_size=CHUNK).commit(data["ft2"], base="main", base_repo=root / "ft")
    return ids


def assert_whole(repo_path: Path, ref: str, folder: Path, out: Path) -> None:
    """Checkout is byte-identical and fsck (re-hashing every object) finds nothing."""
    repo = Repo(repo_path)
    repo.checkout(ref, out)
    assert tree_digest(out) == tree_digest(folder)
    assert repo.fsck(read_data=True) == []


def objects(path: Path) -> set[str]:
    return set(Repo(path).store.iter_ids())


def dependents_of(path: Path) -> list[str]:
    repo = Repo(path)
    return [d.location for d in read_links(repo.backend, DEPENDENTS_KEY, str(Path(path).resolve()))]


def gc_keeps_everything_needed(base: Path, overlays: dict[Path, tuple[str, Path]], out: Path) -> None:
    """gc in the base (once its own branch is gone) and in each overlay deletes nothing an overlay
    needs: every overlay checks out byte-identical afterwards."""
    b = Repo(base)
    b.delete_branch("pretrained", force=True)
    b.gc(prune_now=True, force=True)
    for path in overlays:
        Repo(path).gc(prune_now=True)
    for i, (path, (ref, folder)) in enumerate(overlays.items()):
        assert_whole(path, ref, folder, out / str(i))
    assert Repo(base).fsck(read_data=True) == []


def test_a_relative_link_upgrades_the_repository_format(tmp_path: Path, data: dict[str, Path]) -> None:
    """An older ckstore would resolve a relative entry against its working folder (and its gc
    would then count the overlay as needing nothing): a repository holding one is version 3, which
    an older ckstore refuses. Repositories without links stay version 2; a version-1 repository
    (kept at its old encodings until repack) records an absolute entry instead."""
    make_project(tmp_path / "project", data)
    assert [config_version(tmp_path / "project" / n) for n in ("base", "ft")] == [3, 3]
    assert config_version(Repo.init(tmp_path / "plain").path) == 2
    old = tmp_path / "v1"
    Repo.init(old, chunk_size=CHUNK)
    (old / "config.json").write_text(
        json.dumps({"ckstore": "repository", "version": 1, "chunk_size": CHUNK, "zstd_level": 3})
    )
    cid = Repo(old).commit(data["ft"], base="pretrained", base_repo=tmp_path / "project" / "base")
    assert config_version(old) == 1
    assert read_paths(Repo(old).backend, ALTERNATES_KEY) == [str((tmp_path / "project" / "base").resolve())]
    assert read_paths(Repo(tmp_path / "project" / "base").backend, DEPENDENTS_KEY) == ["../ft", "../../v1"]
    assert_whole(old, cid, data["ft"], tmp_path / "out")


def config_version(path: Path | None) -> int:
    assert path is not None
    return int(json.loads((path / "config.json").read_text())["version"])


# ---- moving the project folder as a whole needs nothing --------------------------------------------


def test_links_are_recorded_relative_to_each_repository(tmp_path: Path, data: dict[str, Path]) -> None:
    make_project(tmp_path / "project", data, stacked=True)
    ft = Repo(tmp_path / "project" / "ft")
    assert read_paths(ft.backend, ALTERNATES_KEY) == ["../base"]
    assert read_paths(ft.backend, DEPENDENTS_KEY) == ["../ft2"]
    assert read_paths(Repo(tmp_path / "project" / "base").backend, DEPENDENTS_KEY) == ["../ft"]
    assert read_paths(ft.backend, LOCATION_KEY) == [str((tmp_path / "project" / "ft").resolve())]


def test_moving_both_repositories_together_needs_nothing(tmp_path: Path, data: dict[str, Path]) -> None:
    ids = make_project(tmp_path / "project", data, stacked=True)
    shutil.move(tmp_path / "project", tmp_path / "elsewhere")
    moved = tmp_path / "elsewhere"
    run = cli("--repo", moved / "ft2", "checkout", ids["ft2"], "-o", tmp_path / "cli-out")
    assert run.exit_code == 0, run.output
    assert tree_digest(tmp_path / "cli-out") == tree_digest(data["ft2"])
    for name in ("ft", "ft2"):
        assert_whole(moved / name, ids[name], data[name], tmp_path / f"out-{name}")
    assert cli("--repo", moved / "base", "fsck").exit_code == 0
    # A new overlay from the moved repository rewrites its links from where it is now.
    Repo(moved / "ft").commit(data["ft2"], branch="again", base="pretrained", base_repo=moved / "base")
    assert read_paths(Repo(moved / "ft").backend, LOCATION_KEY) == [str(moved.resolve() / "ft")]
    assert dependents_of(moved / "base") == [str(moved.resolve() / "ft")]
    gc_keeps_everything_needed(
        moved / "base",
        {moved / "ft": (ids["ft"], data["ft"]), moved / "ft2": (ids["ft2"], data["ft2"])},
        tmp_path / "after-gc",
    )


# ---- moving one of them: every command names relink, and relink repairs both sides ---------------


def test_moving_only_the_base(tmp_path: Path, data: dict[str, Path]) -> None:
    ids = make_project(tmp_path / "project", data)
    ft, new_base = tmp_path / "project" / "ft", tmp_path / "models" / "base"
    new_base.parent.mkdir()
    shutil.move(tmp_path / "project" / "base", new_base)
    base_objects = objects(new_base)

    problems = Repo(ft).fsck()
    assert problems[0].startswith("base repository unreachable: ../base") and "relink NEW_LOCATION" in problems[0]
    run = cli("--repo", ft, "checkout", ids["ft"], "-o", tmp_path / "out")
    assert run.exit_code == ObjectMissingError.exit_code and "relink NEW_LOCATION" in run.output
    assert run.output.count("\n") == 1
    assert any("dependent repository unreachable" in p and "relink --dependent" in p for p in Repo(new_base).fsck())
    with pytest.raises(DependentNotFoundError, match="relink"):
        Repo(new_base).gc()
    assert objects(new_base) == base_objects

    run = cli("--repo", ft, "relink", new_base)
    assert run.exit_code == 0, run.output
    assert "recorded as ../../models/base (was ../base)" in run.output
    assert read_paths(Repo(ft).backend, ALTERNATES_KEY) == ["../../models/base"]
    assert read_paths(Repo(new_base).backend, DEPENDENTS_KEY) == ["../../project/ft"]
    assert_whole(ft, ids["ft"], data["ft"], tmp_path / "out")
    assert Repo(new_base).fsck(read_data=True) == []
    gc_keeps_everything_needed(new_base, {ft: (ids["ft"], data["ft"])}, tmp_path / "after-gc")


@pytest.mark.parametrize("from_side", ["overlay", "base"])
def test_moving_only_the_overlay(tmp_path: Path, data: dict[str, Path], from_side: str) -> None:
    ids = make_project(tmp_path / "project", data)
    base, new_ft = tmp_path / "project" / "base", tmp_path / "runs" / "ft"
    new_ft.parent.mkdir()
    shutil.move(tmp_path / "project" / "ft", new_ft)
    base_objects = objects(base)

    assert any("base repository unreachable" in p and "relink NEW_LOCATION" in p for p in Repo(new_ft).fsck())
    run = cli("--repo", base, "fsck")
    assert run.exit_code != 0 and "relink --dependent NEW_LOCATION" in run.output and "relink --prune" in run.output
    for dry_run in (True, False):
        run = cli("--repo", base, "gc", *(["--dry-run"] if dry_run else []))
        assert run.exit_code == DependentNotFoundError.exit_code and run.output.count("\n") == 1
        assert "gc stopped" in run.output and "relink --dependent" in run.output
    assert objects(base) == base_objects

    if from_side == "overlay":
        run = cli("--repo", new_ft, "relink", base)
    else:
        run = cli("--repo", base, "relink", "--dependent", new_ft)
    assert run.exit_code == 0, run.output
    assert "forgot the old dependent entry ../ft" in run.output
    assert dependents_of(base) == [str(new_ft.resolve())]  # the old entry is gone, not kept beside
    assert read_paths(Repo(new_ft).backend, LOCATION_KEY) == [str(new_ft.resolve())]
    assert_whole(new_ft, ids["ft"], data["ft"], tmp_path / "out")
    gc_keeps_everything_needed(base, {new_ft: (ids["ft"], data["ft"])}, tmp_path / "after-gc")


def test_moving_the_middle_of_a_stack(tmp_path: Path, data: dict[str, Path]) -> None:
    """base <- ft <- ft2, and only ft moves: ft relinks to its base, ft2 to ft."""
    ids = make_project(tmp_path / "project", data, stacked=True)
    project, new_ft = tmp_path / "project", tmp_path / "moved-ft"
    shutil.move(project / "ft", new_ft)
    run = cli("--repo", project / "ft2", "checkout", ids["ft2"], "-o", tmp_path / "out")
    assert run.exit_code == ObjectMissingError.exit_code and "relink" in run.output
    assert cli("--repo", new_ft, "relink", project / "base").exit_code == 0
    # ft2 still cannot open ft: fsck there names the command, which then repairs it.
    assert any("relink NEW_LOCATION" in p for p in Repo(project / "ft2").fsck())
    run = cli("--repo", project / "ft2", "relink", new_ft)
    assert run.exit_code == 0, run.output
    assert dependents_of(new_ft) == [str((project / "ft2").resolve())]
    assert_whole(project / "ft2", ids["ft2"], data["ft2"], tmp_path / "out")
    gc_keeps_everything_needed(
        project / "base",
        {new_ft: (ids["ft"], data["ft"]), project / "ft2": (ids["ft2"], data["ft2"])},
        tmp_path / "after-gc",
    )


# ---- gc in a base whose dependent cannot be found ----------------------------------------------------


def test_gc_in_the_base_refuses_while_a_dependent_cannot_be_opened(tmp_path: Path, data: dict[str, Path]) -> None:
    """A dependent that cannot be opened may only have moved: gc (and its dry run) refuse rather
    than delete what it needs. Once it is known to be deleted, --prune forgets it."""
    make_project(tmp_path / "project", data)
    base = tmp_path / "project" / "base"
    Repo(base).delete_branch("pretrained", force=True)  # only the overlay keeps the base's objects alive
    shutil.move(tmp_path / "project" / "ft", tmp_path / "ft-elsewhere")
    before = objects(base)
    for kwargs in ({"prune_now": True, "force": True}, {"dry_run": True, "prune_now": True}, {"keep_last": 1}):
        with pytest.raises(DependentNotFoundError, match="relink --prune"):
            Repo(base).gc(**kwargs)  # type: ignore[arg-type]
    assert objects(base) == before
    # A damaged dependent is not "gone": --prune keeps it, and gc still refuses.
    (tmp_path / "project" / "ft").mkdir()
    (tmp_path / "project" / "ft" / "config.json").write_text("{not json")
    assert Repo(base).relink(prune=True).pruned == []
    with pytest.raises(DependentNotFoundError):
        Repo(base).gc(prune_now=True, force=True)
    # Deleted for good: --prune forgets it, and then gc frees what only it needed.
    shutil.rmtree(tmp_path / "project" / "ft")
    run = cli("--repo", base, "relink", "--prune")
    assert run.exit_code == 0 and "forgot dependent" in run.output and f"{tmp_path.resolve()}/project/ft" in run.output
    assert read_paths(Repo(base).backend, DEPENDENTS_KEY) == []
    assert Repo(base).fsck() == []
    assert Repo(base).gc(prune_now=True, force=True).deleted_objects == len(before)


# ---- relink checks what it is told -----------------------------------------------------------------


def test_relink_refuses_a_repository_that_is_not_the_base(tmp_path: Path, data: dict[str, Path]) -> None:
    make_project(tmp_path / "project", data)
    ft = tmp_path / "project" / "ft"
    shutil.move(tmp_path / "project" / "base", tmp_path / "base-moved")
    other = Repo.init(tmp_path / "other", chunk_size=CHUNK)
    other.commit(data["ft2"])
    alternates = (ft / ALTERNATES_KEY).read_bytes()
    run = cli("--repo", ft, "relink", tmp_path / "other")
    assert run.exit_code == InvalidInputError.exit_code and "is not the base repository" in run.output
    assert run.output.count("\n") == 1
    run = cli("--repo", ft, "relink", tmp_path / "nowhere")
    assert run.exit_code == NotFoundError.exit_code
    run = cli("--repo", ft, "relink")  # nothing given for the base that does not open
    assert run.exit_code == NotFoundError.exit_code and "give its new location" in run.output
    assert (ft / ALTERNATES_KEY).read_bytes() == alternates
    assert not (tmp_path / "other" / DEPENDENTS_KEY).exists()
    # With the base back in place and opening, another repository is not one of its bases.
    assert cli("--repo", ft, "relink", tmp_path / "base-moved").exit_code == 0
    with pytest.raises(InvalidInputError, match="is not a base repository"):
        Repo(ft).relink([tmp_path / "other"])
    with pytest.raises(InvalidInputError, match="its own base"):
        Repo(ft).relink([ft])


def test_a_copied_overlay_does_not_unprotect_the_original(tmp_path: Path, data: dict[str, Path]) -> None:
    """relink in a copy must not drop the original's entry from the base: it still exists."""
    ids = make_project(tmp_path / "project", data)
    project = tmp_path / "project"
    shutil.copytree(project / "ft", tmp_path / "ft-copy")
    run = cli("--repo", tmp_path / "ft-copy", "relink", project / "base")
    assert run.exit_code == 0, run.output
    assert sorted(dependents_of(project / "base")) == sorted(
        str(p.resolve()) for p in (project / "ft", tmp_path / "ft-copy")
    )
    gc_keeps_everything_needed(
        project / "base",
        {project / "ft": (ids["ft"], data["ft"]), tmp_path / "ft-copy": (ids["ft"], data["ft"])},
        tmp_path / "after-gc",
    )


def test_repositories_with_absolute_links_still_work(tmp_path: Path, data: dict[str, Path]) -> None:
    """Repositories written before relative links (absolute lines, no location file) are read as
    they are; relink rewrites them, after which moving the project folder needs nothing."""
    ids = make_project(tmp_path / "project", data)
    project = tmp_path / "project"
    base, ft = (project / "base").resolve(), (project / "ft").resolve()
    (ft / ALTERNATES_KEY).write_text(f"{base}\n")
    (base / DEPENDENTS_KEY).write_text(f"{ft}\n")
    (ft / LOCATION_KEY).unlink()
    assert_whole(ft, ids["ft"], data["ft"], tmp_path / "out")
    assert Repo(base).fsck() == []
    # The overlay moves; its absolute line still opens the base, but the base lost track of it.
    shutil.move(ft, project / "ft-new")
    assert any("does not list" in p and "relink'" in p for p in Repo(project / "ft-new").fsck())
    run = cli("--repo", project / "ft-new", "relink")
    assert run.exit_code == 0 and "recorded as ../base" in run.output
    # Without a recorded location the old absolute entry cannot be told from another overlay's:
    # it stays until --prune, and gc refuses meanwhile.
    assert any("dependent repository unreachable" in p for p in Repo(base).fsck())
    assert cli("--repo", base, "relink", "--prune").exit_code == 0
    assert dependents_of(base) == [str(project.resolve() / "ft-new")]
    shutil.move(project, tmp_path / "moved")
    assert_whole(tmp_path / "moved" / "ft-new", ids["ft"], data["ft"], tmp_path / "out2")
    assert Repo(tmp_path / "moved" / "base").fsck() == []


# ---- the path rule -------------------------------------------------------------------------------

_segment = st.text(alphabet="abc.-_ é", min_size=1, max_size=4).filter(lambda s: s not in (".", ".."))
_paths = st.lists(_segment, min_size=1, max_size=5)


@given(_paths, _paths, st.booleans(), _paths)
def test_an_entry_names_its_target_and_survives_moving_their_common_folder(
    target: list[str], holder: list[str], share: bool, moved_to: list[str]
) -> None:
    root = "/zz-ckstore-nonexistent"  # real paths are resolved; these exist nowhere
    t = "/".join([root, *target]) if share else "/" + "/".join(["zz-" + target[0], *target[1:]])
    h = "/".join([root, *holder])
    entry = link_entry(t, h)
    assert resolve_entry(entry, h) == t
    assert os.path.isabs(entry) != share  # relative exactly when they share a folder below the root
    if share:  # the whole folder moves: the entry still names the target
        new_root = "/zz-moved/" + "/".join(moved_to)
        assert resolve_entry(entry, h.replace(root, new_root, 1)) == t.replace(root, new_root, 1)
    assert link_entry(t, h, same_device=False) == t  # another disk: absolute


def test_a_location_with_a_newline_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="control characters"):
        link_entry("/data/base\n/etc", "/data/ft")


def test_relink_says_when_there_is_nothing_to_do(tmp_path: Path, data: dict[str, Path]) -> None:
    make_project(tmp_path / "project", data)
    run = cli("--repo", tmp_path / "project" / "base", "relink")
    assert run.exit_code == 0 and run.output == "nothing to relink: this repository has no base repository\n"
    run = cli("--repo", tmp_path / "project" / "base", "relink", "--prune")
    assert run.exit_code == 0 and run.output == "no dependent to forget: every one listed is still there\n"
    assert dependents_of(tmp_path / "project" / "base") == [str((tmp_path / "project" / "ft").resolve())]
    run = cli("--repo", tmp_path / "project" / "ft", "relink")  # in place: rewrites nothing new
    assert run.exit_code == 0 and run.output.endswith("recorded as ../base (unchanged)\n")
    with pytest.raises(InvalidInputError, match="in-memory"):
        Repo.memory().relink()

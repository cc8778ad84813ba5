"""Corruption detection: bit flips (hypothesis), truncation and loss of objects, manifests and refs.

For each damage: ``fsck --read-data`` reports exactly the damaged object or ref (one line, naming
it); checkout of every affected commit fails with an error naming the object and, for a chunk,
its file and tensor; every unaffected commit still checks out byte-identical. A flip that leaves
the decoded bytes intact (a zstd header bit that does not change the output) is harmless by
definition: integrity is defined on decoded bytes, which are re-hashed against the name. Such
flips are counted separately.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckstore.errors import CkstoreError, IntegrityError, NotFoundError
from ckstore.repo import Repo

from .helpers import (
    assert_clean_error,
    checkout_digest,
    count,
    flip_bit,
    object_path,
    refs_of,
    reproducible_commits,
    run_cli,
    temp_files,
    tree_digest,
    write_checkpoint,
)


@dataclass
class Damaged:
    root: Path  # repo/ lives here
    contents: dict[str, dict[str, str]]  # commit -> digest
    commits: list[str]
    refs: dict[str, str]  # ref -> commit
    users: dict[str, dict[str, str]]  # chunk id -> {commit: context ("file 'x', tensor 'y'")}
    objects: list[str]


@pytest.fixture(scope="session")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Damaged:
    root = tmp_path_factory.mktemp("pristine")
    repo = Repo.init(root / "repo", chunk_size=4096)
    contents = {}
    with reproducible_commits():  # the same targets for the same draws in every run
        for seed, branch in ((1, "main"), (2, "main"), (3, "other")):
            digest = write_checkpoint(root / "src", seed, 1200)
            if branch == "other" and "other" not in repo.branches():
                repo.create_branch("other", "main")
            contents[repo.commit([root / "src"], branch=branch)] = digest
            shutil.rmtree(root / "src")
    repo.wait()  # compaction done: the pristine repository is copied and damaged from here
    commits = list(contents)
    repo.create_tag("first", commits[0])
    users: dict[str, dict[str, str]] = {}
    for oid in commits:
        for f in repo.read_commit(oid).files:
            for c in [*f.header, *f.chunks]:
                users.setdefault(c.id, {})[oid] = f"file {f.path!r})"
            for t in f.tensors:
                for c in t.chunks:
                    users.setdefault(c.id, {})[oid] = f"file {f.path!r}, tensor {t.name!r})"
    return Damaged(root, contents, commits, refs_of(root / "repo"), users, sorted(repo.store.iter_ids()))


def _fresh(pristine: Damaged, work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine.root / "repo", work)
    return work


def _check_damage(pristine: Damaged, repo_path: Path, damaged: str, scratch: Path) -> None:
    """``damaged``: an object id, or a ref (``refs/…``). Asserts the detection promises."""
    repo = Repo(repo_path)
    problems = repo.fsck(read_data=True)
    assert len(problems) == 1, problems
    assert damaged in problems[0], (damaged, problems)
    if damaged.startswith("refs/"):
        affected: set[str] = set()
        name = damaged.split("/", 2)[2]
        with pytest.raises(CkstoreError):
            repo.checkout(name, scratch / "refused-ref")
    elif damaged in pristine.contents:
        affected = {damaged}
    else:
        affected = set(pristine.users.get(damaged, {}))
        assert affected, "every object of the pristine repository is used"
    for oid in pristine.commits:
        if oid in affected:
            out = scratch / f"refused-{oid[:12]}"
            shutil.rmtree(out, ignore_errors=True)
            with pytest.raises((IntegrityError, NotFoundError)) as info:
                repo.checkout(oid, out)
            message = str(info.value)
            assert damaged in message, message
            if oid != damaged:  # a chunk: its file, and its tensor when it belongs to one
                assert pristine.users[damaged][oid] in message, message
                # Files written before the failure are whole; the failed one is absent.
                assert tree_digest(out).items() <= pristine.contents[oid].items()
                assert not temp_files(out)
        else:
            assert checkout_digest(repo, oid, scratch) == pristine.contents[oid], oid


def _targets(pristine: Damaged) -> list[str]:
    return [*pristine.objects, *sorted(pristine.refs)]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_bit_flip_is_detected(pristine: Damaged, tmp_path: Path, data: st.DataObject) -> None:
    target = data.draw(st.sampled_from(_targets(pristine)), label="target")
    repo_path = _fresh(pristine, tmp_path / "repo")
    path = repo_path / target if target.startswith("refs/") else object_path(repo_path, target)
    offset = data.draw(st.integers(0, path.stat().st_size - 1), label="offset")
    flip_bit(path, offset, data.draw(st.integers(0, 7), label="bit"))
    if not target.startswith("refs/"):
        try:
            Repo(repo_path).store.verify(target)
        except CkstoreError:
            pass
        else:  # the decoded bytes still hash to the name: the data is intact
            count("bit_flips_harmless")
            assert Repo(repo_path).fsck(read_data=True) == []
            return
    _check_damage(pristine, repo_path, target, tmp_path / "scratch")
    count("bit_flips_detected")


@pytest.mark.parametrize("cut", ["empty", "header", "half", "last-byte"])
def test_truncated_objects_are_detected(pristine: Damaged, tmp_path: Path, cut: str) -> None:
    for oid in pristine.objects:
        repo_path = _fresh(pristine, tmp_path / "repo")
        path = object_path(repo_path, oid)
        size = path.stat().st_size
        keep = {"empty": 0, "header": min(16, size - 1), "half": size // 2, "last-byte": size - 1}[cut]
        with open(path, "r+b") as f:
            f.truncate(keep)
        _check_damage(pristine, repo_path, oid, tmp_path / "scratch")
        count("truncations_detected")


def test_missing_objects_are_detected(pristine: Damaged, tmp_path: Path) -> None:
    for oid in pristine.objects:
        repo_path = _fresh(pristine, tmp_path / "repo")
        object_path(repo_path, oid).unlink()
        _check_damage(pristine, repo_path, oid, tmp_path / "scratch")
        count("missing_objects_detected")


def test_cli_names_the_damage(pristine: Damaged, tmp_path: Path) -> None:
    """Through the command line: one line, exit 4 for corrupt data, exit 3 for a missing object."""
    chunk = next(c for c, users in pristine.users.items() if "tensor 'model.w'" in "".join(users.values()))
    commit = next(iter(pristine.users[chunk]))
    repo_path = _fresh(pristine, tmp_path / "repo")
    flip_bit(object_path(repo_path, chunk), -1, 3)
    proc = run_cli("checkout", commit, "-o", tmp_path / "out", repo=repo_path)
    assert_clean_error(proc, 4, chunk, "file 'model.safetensors'", "tensor 'model.w'", "corrupt")
    assert tree_digest(tmp_path / "out").items() <= pristine.contents[commit].items()  # whole files only
    assert not temp_files(tmp_path / "out")
    proc = run_cli("fsck", "--read-data", repo=repo_path)
    assert proc.returncode == 4 and proc.stdout.count("\n") == 1 and chunk in proc.stdout, proc.stdout
    object_path(repo_path, chunk).unlink()
    proc = run_cli("checkout", commit, "-o", tmp_path / "out", repo=repo_path)
    assert_clean_error(proc, 3, chunk, "is missing", "tensor 'model.w'")

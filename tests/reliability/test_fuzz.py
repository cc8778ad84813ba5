"""Property and fuzz tests that the unit suites do not already cover.

tests/codecs/test_objects.py, tests/format/test_manifest.py and tests/format/test_safetensors.py check that
random mutations raise only ckstore's errors. Here: what a decoder *accepts* re-encodes to the
same bytes (manifests, raw objects) or the same meaning (safetensors headers); the decoders
stacked as a reader meets them (object codec, then manifest) let only ckstore errors escape; and
a stateful test drives a repository through commit, branch, tag, gc with retention, corruption
and checkout against an in-memory model of what every ref must check out.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ckstore.codecs.objects import HEADER, HEADER_SIZE, Encoding, Kind, decode, encode, parse_header
from ckstore.errors import CkstoreError, IntegrityError, SafetensorsFormatError
from ckstore.format.manifest import canonical_json, decode_commit, encode_commit
from ckstore.format.safetensors import DTYPE_BITS, emit_header
from ckstore.format.safetensors import parse_header as parse_st
from ckstore.repo import Repo

from .helpers import count, flip_bit, object_path, reproducible_commits, st_bytes, tree_digest

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ID = "ab" * 32


def _manifest() -> dict[str, Any]:
    return {
        "ckstore": 1,
        "parents": [ID],
        "time": "2026-01-01T00:00:00.000000Z",
        "branch": "main",
        "message": "m",
        "metadata": {"epoch": 3, "loss": 0.5},
        "provenance": {"python": "3.11"},
        "logical_bytes": 24,
        "added_bytes": 10,
        "state": None,
        "files": [
            {
                "path": "a/model.safetensors",
                "kind": "safetensors",
                "size": 16,
                "header": [[ID, 8]],
                "tensors": [{"name": "w", "dtype": "F32", "shape": [2], "chunks": [[ID, 8]]}],
            },
            {"path": "b.json", "kind": "blob", "size": 8, "chunks": [[ID, 8]]},
        ],
    }


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
    | st.just(ID)
    | st.sampled_from(sorted(DTYPE_BITS))
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _places(value: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    if isinstance(value, dict):
        for key, child in value.items():
            out.append((value, key))
            _places(child, out)
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out.append((value, i))
            _places(child, out)
    return out


@SETTINGS
@given(st.data())
def test_accepted_manifests_re_encode_to_the_same_bytes(data: st.DataObject) -> None:
    doc = _manifest()
    for _ in range(data.draw(st.integers(0, 3))):
        container, key = data.draw(st.sampled_from(_places(doc, [])))
        container[key] = data.draw(JSON_VALUES)
    raw = canonical_json(doc)
    try:
        commit = decode_commit(raw)
    except CkstoreError:
        return
    assert encode_commit(commit) == raw  # one meaning, one encoding: names stay stable
    count("fuzz_manifests_accepted")


@SETTINGS
@given(st.binary(max_size=300), st.sampled_from(list(Kind)), st.data())
def test_accepted_objects_decode_consistently(raw: bytes, kind: Kind, data: st.DataObject) -> None:
    stored = bytearray(encode(raw, kind, 3))
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(stored) - 1))
        stored[i] = data.draw(st.integers(0, 255))
    try:
        out = decode(bytes(stored), kind, 1 << 20)
    except IntegrityError:
        return
    header = parse_header(stored)
    assert len(out) == header.raw_len and header.kind == kind
    if header.encoding == Encoding.RAW:
        assert bytes(stored) == HEADER.pack(b"CKSO", 1, kind, Encoding.RAW, 0, len(out)) + out
    assert decode(encode(out, kind, 3), kind, 1 << 20) == out


@SETTINGS
@given(st.binary(max_size=200), st.data())
def test_stacked_readers_let_only_ckstore_errors_escape(noise: bytes, data: st.DataObject) -> None:
    """A stored commit object damaged anywhere: codec then manifest parser, as Repo.read_commit runs them."""
    stored = bytearray(encode(canonical_json(_manifest()), Kind.COMMIT, 3))
    mode = data.draw(st.sampled_from(["flip", "splice", "replace-body"]))
    if mode == "flip":
        i = data.draw(st.integers(0, len(stored) - 1))
        stored[i] ^= 1 << data.draw(st.integers(0, 7))
    elif mode == "splice":
        i = data.draw(st.integers(0, len(stored)))
        stored[i:i] = noise
    else:
        stored[HEADER_SIZE:] = noise
        stored[8:16] = len(noise).to_bytes(8, "little")
    try:
        decode_commit(decode(bytes(stored), Kind.COMMIT, 1 << 30))
    except CkstoreError:
        pass


TENSORS = st.lists(
    st.tuples(
        st.text(
            st.characters(min_codepoint=0xA0, max_codepoint=0x2FF) | st.sampled_from("abc._"), min_size=1, max_size=4
        ),
        st.sampled_from(["F32", "U8", "BF16", "BOOL", "I64"]),
        st.lists(st.integers(0, 3), max_size=3),
    ),
    max_size=4,
    unique_by=lambda t: t[0],
).filter(lambda ts: all(n != "__metadata__" for n, _, _ in ts))


@SETTINGS
@given(TENSORS, st.none() | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2), st.data())
def test_accepted_safetensors_headers_re_emit_to_the_same_layout(
    tensors: list[tuple[str, str, list[int]]], metadata: dict[str, str] | None, data: st.DataObject
) -> None:
    header, offsets = emit_header(tensors, metadata)
    size = len(header) + (offsets[-1][1] if offsets else 0)
    mutated = bytearray(header)
    if data.draw(st.booleans()) and len(mutated) > 8:
        i = data.draw(st.integers(8, len(mutated) - 1))
        mutated[i] = data.draw(st.sampled_from(b' {}[]",:0123456789abcdefFIU_'))
    try:
        layout = parse_st(bytes(mutated), size)
    except SafetensorsFormatError:
        return
    if layout.plain_reason is not None:
        return  # e.g. a mutation repeated a name: committed as plain bytes, never re-emitted
    again, _ = emit_header([(t.name, t.dtype, t.shape) for t in layout.tensors], layout.metadata)
    relaid = parse_st(again, len(again) + (layout.file_size - layout.data_offset))
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in relaid.tensors] == [
        (t.name, t.dtype, t.shape, t.nbytes) for t in layout.tensors
    ]
    assert relaid.metadata == layout.metadata
    if bytes(mutated) == header:
        assert again == header  # canonical input re-encodes byte for byte


# ---- the stateful test ---------------------------------------------------------------------


class RepositoryMachine(RuleBasedStateMachine):
    """Commit, branch, tag, gc with retention, corruption and checkout against a model.

    Model: ``contents`` (commit -> file digests), ``parents``, ``refs`` (ref -> commit), ``live``
    (commits gc kept). gc keeps every commit a ref reaches, or with ``keep_last`` every tagged
    commit plus, per branch, the N newest kept commits of its chain; refs are created and deleted,
    never moved. Until a corruption, fsck is clean, every ref checks out exactly what was committed,
    and a ref is created on any kept commit but refused on a deleted one or an existing name;
    afterwards every ref either checks out exactly or fails with a ckstore error, and fsck reports
    the damage.

    Replayable by construction: strategies are fixed (names from constant lists, plain integers);
    a rule maps its integers onto the model's current state (commits in creation order, refs
    sorted) instead of assuming on it; and commit ids are fixed by reproducible_commits(), so the
    same draws damage the same byte of the same object. An ``assume`` on state that varied with the
    wall clock made hypothesis raise FlakyStrategyDefinition.
    """

    def __init__(self) -> None:
        super().__init__()
        self.patches = ExitStack()
        self.patches.enter_context(reproducible_commits())
        self.tmp = Path(tempfile.mkdtemp(prefix="ckstore-stateful-"))
        self.repo = Repo.init(self.tmp / "repo", chunk_size=4096)
        self.contents: dict[str, dict[str, str]] = {}
        self.parents: dict[str, str | None] = {}
        self.refs: dict[str, str] = {}
        self.order: list[str] = []  # every commit made, oldest first
        self.live: set[str] = set()
        self.corrupted = False

    def teardown(self) -> None:
        self.patches.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @initialize()
    def first(self) -> None:
        self._commit("main", 0)

    def _commit(self, branch: str, seed: int) -> None:
        src = self.tmp / f"src{len(self.order)}"
        src.mkdir()
        (src / "model.safetensors").write_bytes(
            st_bytes(
                [
                    ("shared", "U8", [300], bytes(300)),
                    ("w", "F32", [seed % 5 * 300], bytes([seed % 251]) * (seed % 5 * 1200)),
                ]
            )
        )
        (src / "notes.txt").write_text(f"seed {seed}\n")
        digest = tree_digest(src)
        ref = f"refs/heads/{branch}"
        try:
            oid = self.repo.commit([src], branch=branch)
        except CkstoreError:
            # The branch's tip was damaged (the corrupt rule): refused, nothing moved.
            assert self.corrupted, f"commit on {branch} refused in an undamaged repository"
            assert self.repo.refs.read(ref) == self.refs.get(ref)
            shutil.rmtree(src)
            return
        self.repo.wait()  # its compaction rewrites objects that the corrupt rule may pick
        shutil.rmtree(src)
        assert oid not in self.contents
        self.parents[oid] = self.refs.get(ref)
        self.contents[oid] = digest
        self.refs[ref] = oid
        self.order.append(oid)
        self.live.add(oid)
        count("stateful_commits")

    @rule(branch=st.integers(0, 2), seed=st.integers(0, 20))
    def commit(self, branch: int, seed: int) -> None:
        heads = sorted(ref for ref in self.refs if ref.startswith("refs/heads/"))
        self._commit(heads[branch % len(heads)].removeprefix("refs/heads/"), seed)

    @rule(
        kind=st.sampled_from(["heads", "tags"]),
        name=st.sampled_from(["dev", "exp/a", "rel/x"]),
        base=st.integers(0, 10**6),
        pruned=st.booleans(),
    )
    def create_ref(self, kind: str, name: str, base: int, pruned: bool) -> None:
        """On a kept commit, or (``pruned``, once gc pruned some) on a pruned one: refused."""
        gone = [oid for oid in self.order if oid not in self.live]
        pool = gone if pruned and gone else [oid for oid in self.order if oid in self.live]
        oid = pool[base % len(pool)]
        ref = f"refs/{kind}/{name}"
        allowed = oid in self.live and ref not in self.refs
        try:
            (self.repo.create_branch if kind == "heads" else self.repo.create_tag)(name, oid)
        except CkstoreError as exc:
            # A damaged commit may be refused as a base too (its header names no commit).
            assert not allowed or self.corrupted, f"{ref} on kept commit {oid} refused: {exc}"
            return
        assert allowed, f"{ref} on {'a pruned commit' if oid not in self.live else 'an existing name'} accepted"
        self.refs[ref] = oid

    @rule(which=st.integers(0, 10**6))
    def delete_ref(self, which: int) -> None:
        """Any ref but main (HEAD's branch); its commits are then kept only through other refs."""
        names = sorted(ref for ref in self.refs if ref != "refs/heads/main")
        if not names:
            return
        ref = names[which % len(names)]
        kind, name = ref.split("/", 2)[1:]
        (self.repo.delete_branch if kind == "heads" else self.repo.delete_tag)(name)
        del self.refs[ref]

    @precondition(lambda self: not self.corrupted)
    @rule()
    def gc(self) -> None:
        """Keeps every commit a ref reaches; those only deleted refs reached go. With prune_now:
        without it a deleted branch's reflog keeps its commits for 30 days (by design, and
        tests/repository/test_reflog.py covers it), which this model does not replicate."""
        self.repo.gc(prune_now=True)
        self.live &= {oid for tip in self.refs.values() for oid in self._chain(tip)}
        count("stateful_gcs")

    @precondition(lambda self: not self.corrupted)
    @rule(keep_last=st.integers(1, 3))
    def gc_keep_last(self, keep_last: int) -> None:
        """Keeps every tagged commit and, per branch, the ``keep_last`` newest kept ones (log's order).
        With prune_now, as in ``gc``: a deleted branch's reflog would keep its commits 30 days."""
        self.repo.gc(keep_last=keep_last, prune_now=True)
        keep = {oid for ref, oid in self.refs.items() if ref.startswith("refs/tags/")}
        for ref, tip in self.refs.items():
            if ref.startswith("refs/heads/"):
                keep.update([oid for oid in self._chain(tip) if oid in self.live][:keep_last])
        self.live &= keep
        count("stateful_gcs")

    def _chain(self, tip: str) -> list[str]:
        """``tip`` and its ancestors, newest first, pruned ones included (history walks through them)."""
        out: list[str] = []
        oid: str | None = tip
        while oid is not None:
            out.append(oid)
            oid = self.parents[oid]
        return out

    @precondition(lambda self: not self.corrupted and len(self.order) >= 3)  # damage a grown repository
    @rule(which=st.integers(0, 10**6), where=st.integers(0, 10**6), bit=st.integers(0, 7))
    def corrupt(self, which: int, where: int, bit: int) -> None:
        ids = sorted(self.repo.store.iter_ids())  # the same ids every run (reproducible_commits)
        oid = ids[which % len(ids)]
        path = object_path(self.repo.path, oid)  # type: ignore[arg-type]
        flip_bit(path, where % path.stat().st_size, bit)
        try:
            self.repo.store.verify(oid)
        except CkstoreError:
            self.corrupted = True
            self.repo = Repo(self.repo.path)  # drop cached commits: readers see the damage
            problems = self.repo.fsck(read_data=True)
            assert problems and all(oid in p for p in problems), problems
            count("stateful_corruptions")

    @rule(ref=st.integers(0, 10**6))
    def checkout(self, ref: int) -> None:
        """By full ref name (a branch and a tag may share a short name; the branch wins)."""
        names = sorted(self.refs)
        self._check_out(self.refs[names[ref % len(names)]], names[ref % len(names)])

    def _check_out(self, oid: str, spec: str | None = None) -> None:
        out = self.tmp / "out"
        shutil.rmtree(out, ignore_errors=True)
        try:
            self.repo.checkout(spec or oid, out)
        except CkstoreError:
            assert self.corrupted, f"checkout of {spec or oid} failed on an undamaged repository"
            return
        assert tree_digest(out) == self.contents[oid]
        count("stateful_checkouts")

    @invariant()
    def refs_match_the_model(self) -> None:
        found = {
            **{f"refs/heads/{k}": v for k, v in self.repo.branches().items()},
            **{f"refs/tags/{k}": v for k, v in self.repo.tags().items()},
        }
        assert found == self.refs

    @invariant()
    def store_matches_the_model_until_corruption(self) -> None:
        """fsck is clean and the stored commits are exactly those gc should have kept."""
        if not self.corrupted:
            assert self.repo.fsck(read_data=True) == []
            stored = {oid for oid in self.repo.store.iter_ids() if self.repo.store.kind(oid) == Kind.COMMIT}
            assert stored == self.live

    @invariant()
    def every_live_ref_checks_out(self) -> None:
        for oid in set(self.refs.values()):
            self._check_out(oid)


RepositoryMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
)
test_repository_state_machine = pytest.mark.slow(RepositoryMachine.TestCase)

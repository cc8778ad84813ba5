"""Per-tensor statistics recorded at commit (format.md 5.1) and computed for older commits."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.errors import IntegrityError
from ckstore.format.manifest import decode_commit, encode_commit
from ckstore.format.tensor_stats import StatsAccumulator, chunk_stats
from ckstore.history.magnitude import commit_stats
from ckstore.repo import Repo
from tests.helpers import save_st


def _manifest(repo: Repo, ref: str):
    return repo.read_commit(repo.resolve(ref))


def _tensors(repo: Repo, ref: str) -> dict[str, object]:
    return {t.name: t for f in _manifest(repo, ref).files for t in f.tensors}


@pytest.fixture
def two_commits(tmp_path: Path) -> tuple[Repo, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    repo = Repo.init(tmp_path / "r" / ".ckstore", chunk_size=4096)  # many chunks per tensor
    g = torch.Generator().manual_seed(1)
    first = {
        "w": torch.randn(50, 100, generator=g),
        "h": torch.randn(3000, generator=g).half(),
        "bf": torch.randn(2048, generator=g).bfloat16(),
        "frozen": torch.randn(4000, generator=g),
        "steps": torch.arange(7, dtype=torch.int64),
        "mask": torch.ones(5, dtype=torch.bool),
    }
    save_st(tmp_path / "ck" / "model.safetensors", first)
    repo.commit([tmp_path / "ck"], message="one")
    second = dict(first)
    second["w"] = first["w"].clone()
    second["w"][:10] += 0.05 * torch.randn(10, 100, generator=g)  # some chunks change, others dedup
    second["h"] = (first["h"].float() * 1.01).half()
    second["bf"] = (first["bf"].float() + 0.1).bfloat16()
    save_st(tmp_path / "ck" / "model.safetensors", second)
    repo.commit([tmp_path / "ck"], message="two")
    return repo, first, second


def test_recorded_figures_match_the_tensors(two_commits) -> None:
    repo, first, second = two_commits
    for ref, tensors in (("HEAD~1", first), ("HEAD", second)):
        recorded = _tensors(repo, ref)
        assert recorded["mask"].stats is None  # bool: no figures
        for name in ("w", "h", "bf", "frozen", "steps"):
            values = tensors[name].double()
            stats = recorded[name].stats
            assert stats.l2 == pytest.approx(float(values.norm()), rel=1e-6)  # float32 sums (format.md 5.1)
            assert stats.absmax == pytest.approx(float(values.abs().max()), rel=1e-12)
            assert stats.nonfinite == 0
    assert all(t.stats is None or t.stats.change is None for t in _tensors(repo, "HEAD~1").values())


def test_change_is_recorded_when_free_and_computed_like_diff_otherwise(two_commits) -> None:
    repo, first, second = two_commits
    recorded = _tensors(repo, "HEAD")
    assert recorded["frozen"].stats.change == 0.0 and recorded["steps"].stats.change == 0.0
    assert all(recorded[name].stats.change is None for name in ("w", "h", "bf"))  # would need the parent's bytes
    figures = {
        name: f for (_, name), f in commit_stats(repo.store, _manifest(repo, "HEAD"), _manifest(repo, "HEAD~1")).items()
    }
    from_diff = {c.name: c.rel_l2 for c in repo.diff("HEAD~1", "HEAD")}
    for name in ("w", "h", "bf"):
        expected = float((second[name].double() - first[name].double()).norm() / first[name].double().norm())
        assert figures[name].change == pytest.approx(expected, rel=1e-9)
        assert figures[name].change == pytest.approx(from_diff[name], rel=1e-12)
    assert figures["frozen"].change == 0.0


def test_an_unchanged_tensor_takes_its_parents_figures_without_computing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen tensor costs a commit its hashing only: its figures are the parent's. A tensor
    where only some chunks changed gets its figures from every chunk, unchanged ones included."""
    import ckstore.write.ingest as ingest
    from ckstore.format.ids import chunk_id

    repo = Repo.init(tmp_path / "r", chunk_size=4096)
    g = torch.Generator().manual_seed(5)
    first = {"frozen": torch.randn(4000, generator=g), "mixed": torch.randn(5000, generator=g)}
    save_st(tmp_path / "ck" / "model.safetensors", first)
    repo.commit([tmp_path / "ck"])
    second = {"frozen": first["frozen"], "mixed": first["mixed"].clone()}
    second["mixed"][-100:] *= 3.0  # the last chunk changes
    save_st(tmp_path / "ck" / "model.safetensors", second)
    computed: list[str] = []
    real = ingest.chunk_stats

    def counting(data, dtype, same_as_parent=False):  # type: ignore[no-untyped-def]
        computed.append(chunk_id(data))
        return real(data, dtype, same_as_parent=same_as_parent)

    monkeypatch.setattr(ingest, "chunk_stats", counting)
    repo.commit([tmp_path / "ck"])
    before, after = _tensors(repo, "HEAD~1"), _tensors(repo, "HEAD")
    assert not {c.id for c in after["frozen"].chunks} & set(computed)
    assert after["frozen"].stats == replace(before["frozen"].stats, change=0.0)
    mixed = second["mixed"].double()
    assert after["mixed"].stats.l2 == pytest.approx(float(mixed.norm()), rel=1e-6)
    assert after["mixed"].stats.absmax == pytest.approx(float(mixed.abs().max()), rel=1e-12)
    assert after["mixed"].stats.change is None  # its changed chunk's difference needs the parent's bytes


def test_non_finite_values_are_counted_and_norms_stay_finite(tmp_path: Path) -> None:
    repo = Repo.init(tmp_path / ".ckstore")
    values = torch.tensor([3.0, float("nan"), 4.0, float("inf"), -float("inf")])
    save_st(tmp_path / "m.safetensors", {"x": torch.zeros(5), "y": values})
    repo.commit([tmp_path / "m.safetensors"], message="zeros")
    save_st(tmp_path / "m.safetensors", {"x": torch.ones(5), "y": values})
    repo.commit([tmp_path / "m.safetensors"], message="bad")
    tensors = _tensors(repo, "HEAD")
    assert (tensors["y"].stats.l2, tensors["y"].stats.absmax, tensors["y"].stats.nonfinite) == (5.0, 4.0, 3)
    assert tensors["y"].stats.change == 0.0  # the same bytes, NaN included: unchanged, as diff says
    figures = commit_stats(repo.store, _manifest(repo, "HEAD"), _manifest(repo, "HEAD~1"))
    assert figures[("m.safetensors", "y")].change == 0.0
    assert figures[("m.safetensors", "x")].change is None  # from all zeros: undefined (diff says inf)


def test_older_commits_get_the_same_figures_on_demand(two_commits) -> None:
    repo, _, _ = two_commits
    store = repo.store
    head, parent = _manifest(repo, "HEAD"), _manifest(repo, "HEAD~1")
    recorded = commit_stats(store, head, parent)
    bare = replace(
        head, files=tuple(replace(f, tensors=tuple(replace(t, stats=None) for t in f.tensors)) for f in head.files)
    )
    old = decode_commit(encode_commit(bare))
    assert encode_commit(bare).startswith(b'{"ckstore":1,')  # no stats: byte for byte the old format
    computed = commit_stats(store, old, parent)
    assert computed.keys() == recorded.keys()
    for key, figures in recorded.items():
        assert computed[key].l2 == pytest.approx(figures.l2, rel=1e-6)
        assert computed[key].absmax == figures.absmax
        assert computed[key].nonfinite == figures.nonfinite
        assert (computed[key].change is None) == (figures.change is None)
        if figures.change is not None:
            assert computed[key].change == pytest.approx(figures.change, rel=1e-9, abs=1e-15)


def test_manifest_with_stats_is_version_3_and_parsed_strictly(two_commits) -> None:
    repo, _, _ = two_commits
    head = _manifest(repo, "HEAD")
    data = encode_commit(head)
    assert data.startswith(b'{"ckstore":3,')
    assert decode_commit(data) == head
    assert (
        _tensors(repo, "HEAD")["w"].stats
        == {t.name: t for f in decode_commit(data).files for t in f.tensors}["w"].stats
    )
    with pytest.raises(IntegrityError, match="malformed tensor entry"):
        decode_commit(data.replace(b'{"ckstore":3,', b'{"ckstore":1,', 1))  # stats need version 3
    with pytest.raises(IntegrityError, match="malformed stats"):
        decode_commit(data.replace(b'"nonfinite":0', b'"nonfinite":-1', 1))
    with pytest.raises(IntegrityError, match="malformed stats"):
        decode_commit(data.replace(b'"nonfinite":0', b'"nonfinite":"0"', 1))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64),
    st.integers(min_value=1, max_value=64),
)
def test_chunked_figures_equal_whole_tensor_figures(values: list[float], cut: int) -> None:
    array = np.array(values, dtype=np.float32)
    total = StatsAccumulator()
    for start in range(0, len(array), cut):
        total.add(chunk_stats(array[start : start + cut].tobytes(), "F32"))
    figures = total.result()
    finite = array[np.isfinite(array)].astype(np.float64)
    assert figures.nonfinite == len(array) - len(finite)
    assert figures.l2 == pytest.approx(math.sqrt(float(np.sum(finite**2))), rel=1e-6)
    assert figures.absmax == (float(np.max(np.abs(finite))) if len(finite) else 0.0)


@pytest.mark.parametrize("dtype, code", [(np.uint8, "U8"), (np.int8, "I8"), (np.int64, "I64"), (np.uint16, "U16")])
def test_integer_absmax_does_not_wrap(dtype: type, code: str) -> None:
    info = np.iinfo(dtype)
    array = np.array([info.min, 5, info.max, 7], dtype=dtype)
    figures = chunk_stats(array.tobytes(), code)
    assert figures.absmax == float(max(abs(int(info.min)), int(info.max)))
    assert figures.sum_sq == pytest.approx(sum(float(v) ** 2 for v in array.tolist()))


@pytest.mark.parametrize("dtype, code", [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.float16, "F16")])
@pytest.mark.parametrize("special", ["none", "nan", "inf"])
def test_chunk_figures_across_blocks_match_float64(dtype: torch.dtype, code: str, special: str) -> None:
    """A chunk longer than the reduction blocks (and the bf16/f16 scratch buffer, reused between
    chunks): its figures are the float64 ones, the largest magnitude negative and in a late block."""
    g = torch.Generator().manual_seed(3)
    for n in (600_001, 70_000):  # the second, shorter chunk reuses a scratch buffer the first filled
        t = torch.randn(n, generator=g).to(dtype)
        t[n - 5] = -40.0
        if special != "none":
            t[150_000 % n] = float(special)
        figures = chunk_stats(t.view(torch.uint8).numpy().tobytes(), code)
        wide = t.double()
        finite = wide[torch.isfinite(wide)]
        assert figures.nonfinite == (0 if special == "none" else 1)
        assert figures.absmax == 40.0 == finite.abs().max().item()
        assert figures.sum_sq == pytest.approx((finite * finite).sum().item(), rel=1e-5)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=0xFFFF), min_size=1, max_size=300))
def test_bf16_figures_of_any_bit_patterns_match_float64(patterns: list[int]) -> None:
    """bf16 elements are read two to a word: every length (the odd last element alone), every
    bit pattern (NaN, ±inf, ±0, subnormals), and the largest magnitude anywhere."""
    bits = np.array(patterns, dtype=np.uint16)
    figures = chunk_stats(bits.tobytes(), "BF16")
    wide = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    finite = wide[np.isfinite(wide)]
    assert figures.nonfinite == len(wide) - len(finite)
    assert figures.absmax == (float(np.max(np.abs(finite))) if len(finite) else 0.0)
    assert figures.sum_sq == pytest.approx(float(np.sum(finite**2)), rel=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-(2.0**100), 2.0**100, width=32), st.floats(-(2.0**100), 2.0**100, width=32)),
        min_size=1,
        max_size=40000,
    ),
    st.sampled_from(["F32", "BF16"]),
)
def test_difference_sums_are_the_float64_sums_of_the_exact_values(pairs: list[tuple[float, float]], dtype: str) -> None:
    """The change record's partial sums (compaction) and diff's are this one function: its
    figures are ‖new − old‖² and ‖old‖² of the exact values, summed in float64 (bf16 widened
    exactly), at any length (einsum sums in blocks)."""
    from ckstore.format.tensor_stats import difference_sums

    old32 = np.array([p[0] for p in pairs], np.float32)
    new32 = np.array([p[1] for p in pairs], np.float32)
    if dtype == "BF16":  # the top half of each float32 is a bf16 value; widened back exactly
        old_bytes = (old32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        new_bytes = (new32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        old32 = (np.frombuffer(old_bytes, np.uint16).astype(np.uint32) << 16).view(np.float32)
        new32 = (np.frombuffer(new_bytes, np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        old_bytes, new_bytes = old32.tobytes(), new32.tobytes()
    change, norm = difference_sums(old_bytes, new_bytes, dtype)
    d = new32.astype(np.float64) - old32.astype(np.float64)
    assert change == pytest.approx(math.fsum(d * d), rel=1e-12)
    assert norm == pytest.approx(math.fsum(old32.astype(np.float64) ** 2), rel=1e-12)


def test_difference_sums_of_tensors_holding_inf_and_nan_warn_nothing() -> None:
    import warnings

    from ckstore.format.tensor_stats import difference_sums

    old = np.array([1.0, np.inf, np.nan, 3e300, 2.0], np.float64)
    new = np.array([1.5, np.inf, 0.0, -3e300, 2.0], np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a raw numpy RuntimeWarning would reach the user's terminal
        diff_sq, base_sq = difference_sums(old.tobytes(), new.tobytes(), "F64")
    assert np.isnan(diff_sq) and np.isnan(base_sq)

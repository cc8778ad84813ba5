"""The compiled predictions (predict_kernels.py) compute the numpy reference's bits exactly (the
format's rule: every platform and implementation the same prediction), so objects written with
either decode with the other."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.codecs import predict
from ckstore.codecs.objects import Kind, decode, encode_predicted
from ckstore.codecs.predict import Predictor
from ckstore.format.ids import chunk_id
from tests.codecs.test_predict import _adamw_states, cases

pytest.importorskip("numba")


@pytest.fixture(autouse=True)
def compiled() -> Iterator[None]:
    assert predict.load_compiled()
    yield


@settings(max_examples=500, deadline=None)
@given(cases())
def test_kernels_predict_the_references_bits(case: tuple[Predictor, tuple[float, ...], bytes, list[bytes]]) -> None:
    """Hostile words (subnormals, infinities, NaNs of any payload, negative second moments) and
    any coefficients the format allows, the same prediction bit for bit."""
    predictor, coefficients, _, bases = case
    got = predict.predict(predictor, coefficients, bases)
    assert got.tolist() == predict.predict_numpy(predictor, coefficients, bases).tolist()


@settings(max_examples=200, deadline=None)
@given(cases())
def test_a_fits_scoring_counts_what_the_reference_counts(
    case: tuple[Predictor, tuple[float, ...], bytes, list[bytes]],
) -> None:
    predictor, coefficients, raw, bases = case
    with np.errstate(all="ignore"):
        converted = [predict.inputs(b) for b in bases]
    target = np.frombuffer(raw, dtype="<u4")
    want = int((predict.predict_numpy(predictor, coefficients, bases) == target).sum())
    assert predict._exact(predictor, coefficients, converted, target) == want
    assert predict._exact(
        predictor, coefficients, converted, predict.predict_numpy(predictor, coefficients, bases)
    ) == len(target)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_a_fits_sample_is_gathered_and_converted_as_the_reference_does(
    case: tuple[Predictor, tuple[float, ...], bytes, list[bytes]],
) -> None:
    """The compiled gather of a fit's sample: the same words and the same binary64 values as
    numpy's gather and ``inputs`` (subnormals zeroed by their bits, NaN payloads kept)."""
    predictor, _, raw, bases = case
    sample = predict._Sample(predictor, raw, bases)
    index = predict._sample_index(len(raw) // 4)
    assert sample.bits.tobytes() == np.frombuffer(raw, dtype="<u4")[index].tobytes()
    with np.errstate(all="ignore"):
        for got, base in zip([sample.y, *sample.bases], [raw, *bases]):
            assert got.tobytes() == predict.inputs(np.frombuffer(base, dtype="<u4")[index]).tobytes()


def test_objects_written_with_numpy_and_with_the_kernels_are_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real AdamW steps: the fitted coefficients, the encoded objects and their decodes agree
    byte for byte whichever way the prediction was computed (the objects main's numpy code
    wrote read back under the kernels, and the reverse)."""
    (w1, m1, v1), (w2, m2, v2) = _adamw_states(128, 3, 1)[-2:]
    for predictor, target, bases in (
        (Predictor.ADAM_WEIGHT, w1, [w2, m2, v2]),
        (Predictor.ADAM_SECOND_MOMENT, v1, [v2, m2, m1]),
    ):
        ids = tuple(chunk_id(b + bytes([i])) for i, b in enumerate(bases))
        by_id = dict(zip(ids, bases))

        def written() -> tuple[tuple[float, ...] | None, bytes | None]:
            found = predict.fit(predictor, target, bases)
            assert found is not None
            return found, encode_predicted(target, 1, ids, bases, predictor, found, 1 << 30)

        def read(data: bytes) -> bytes:
            return decode(data, Kind.CHUNK, 1 << 28, expected_len=len(target), fetch_base=lambda b, n: by_id[b])

        compiled = written()
        with monkeypatch.context() as mp:
            mp.setattr(predict, "_KERNELS", [None])  # as a process without numba
            reference = written()
            assert reference[1] is not None and read(compiled[1]) == target  # type: ignore[arg-type]
        assert compiled == reference
        assert read(reference[1]) == target


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=4, max_size=4096).filter(lambda b: len(b) % 4 == 0), st.integers(0, 1 << 30), st.data())
def test_a_residual_is_checked_in_one_pass_as_joining_and_xoring_would(
    raw: bytes, seed: int, data: st.DataObject
) -> None:
    """``residual_matches`` (compaction's check of a predicted delta: join the residual's planes,
    XOR the prediction, compare) says what numpy's join, XOR and comparison say, for the true
    residual and for one with any bit of any element flipped, in any plane."""
    from ckstore.codecs import predict_kernels

    words = np.frombuffer(raw, dtype="<u4")
    guess = np.random.default_rng(seed).integers(0, 1 << 32, words.size, dtype=np.uint32)
    planes = np.empty((4, words.size), dtype=np.uint8)
    predict_kernels.residual_planes(words, guess, planes)
    assert predict_kernels.residual_matches(*planes, guess, words)
    element, bit = data.draw(st.integers(0, words.size - 1)), data.draw(st.integers(0, 31))
    damaged = planes.copy()
    damaged[bit // 8, element] ^= np.uint8(1 << (bit % 8))
    joined = damaged.T.copy().view("<u4").reshape(-1)
    assert not np.array_equal(joined ^ guess, words)
    assert not predict_kernels.residual_matches(*damaged, guess, words)


def test_a_predicted_object_is_checked_alike_with_and_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``predicted_decodes_to``: the compiled pass and numpy's decode agree on a real object, on
    a wrong prediction, and on a damaged residual (refused by both, the same way)."""
    from ckstore.codecs.objects import predicted_decodes_to
    from ckstore.errors import IntegrityError

    (w1, _, _), (w2, m2, v2) = _adamw_states(256, 2, 1)
    bases = [w2, m2, v2]
    coefficients = predict.fit(Predictor.ADAM_WEIGHT, w1, bases)
    assert coefficients is not None
    ids = tuple(chunk_id(b) for b in bases)
    guess = predict.predict(Predictor.ADAM_WEIGHT, coefficients, bases)
    data = encode_predicted(w1, 1, ids, bases, Predictor.ADAM_WEIGHT, coefficients, 1 << 30, guess=guess)
    assert data is not None
    damaged = bytearray(data)
    damaged[-7] ^= 0x10

    def outcomes() -> list[object]:
        found: list[object] = []
        for g in (guess, guess ^ np.uint32(1)):
            inputs, decodes = predicted_decodes_to(data, w1, g)
            found.append((inputs.base_ids, inputs.predictor, inputs.coefficients, decodes))
        try:
            found.append(predicted_decodes_to(bytes(damaged), w1, guess)[1])
        except IntegrityError as exc:
            found.append(str(exc))
        return found

    compiled = outcomes()
    with monkeypatch.context() as mp:
        mp.setattr(predict, "_KERNELS", [None])
        assert outcomes() == compiled
    assert compiled[0] == (ids, Predictor.ADAM_WEIGHT, coefficients, True) and compiled[1][-1] is False  # type: ignore[index]
    assert compiled[2] is False or isinstance(compiled[2], str)


def test_the_machine_code_holds_no_fused_multiply_add() -> None:
    """A fused multiply-add rounds once where the format rounds twice: LLVM must not contract
    (on x86 with FMA, the usual host). Compiled afresh: numba cannot show cached machine code."""
    import numba

    from ckstore.codecs import predict_kernels

    rng = np.random.default_rng(0)
    bits = [rng.random(64, dtype=np.float32).view(np.uint32) for _ in range(3)]
    args = [a for b in bits for a in (b, b.view(np.float32))]
    for kernel, c in (
        (predict_kernels.second_moment, (1.0, 0.1, 0.2, 0.3)),
        (predict_kernels.weight, (1.0, 1e-3, 1e-8)),
    ):
        options = {k: v for k, v in predict_kernels._OPTIONS.items() if k != "cache"}
        fresh = numba.njit(**options)(kernel.py_func)
        fresh(np.array(c), *args, np.empty(64, np.float32))
        asm = fresh.inspect_asm(fresh.signatures[0])
        assert re.search(r"\bv?mul[sp]d\b", asm), "not the kernel's machine code"
        assert not re.search(r"\bv?fn?m(add|sub)\w*\b", asm), kernel

"""The predicted delta (codec encoding 4) and its predictors (predict.py): any float32 input round
trips exactly, the prediction is computed the same way whatever the coefficients, and damaged or
hostile objects are refused with an IntegrityError."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.codecs import predict
from ckstore.codecs.objects import (
    BASES_PREFIX_SIZE,
    HEADER_SIZE,
    Encoding,
    Kind,
    decode,
    delta_bases,
    encode_chunk,
    encode_predicted,
    parse_header,
    predicted_parts,
)
from ckstore.codecs.predict import Predictor
from ckstore.errors import IntegrityError
from ckstore.format.ids import chunk_id

# Bit patterns worth covering on purpose: zeros, subnormals, the normal range's ends, infinities,
# NaNs with various payloads and signs, and negative values (a negative "second moment").
SPECIAL = [
    0x00000000,
    0x80000000,
    0x00000001,
    0x807FFFFF,
    0x00800000,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0x7F800001,
    0xFFC00123,
    0x3F800000,
    0xBF800000,
    0x3A83126F,
]
words = st.one_of(
    st.sampled_from(SPECIAL),
    st.integers(0, 2**32 - 1),
    st.floats(-10, 10, width=32).map(lambda f: struct.unpack("<I", struct.pack("<f", f))[0]),
)
coefficient = st.one_of(st.just(0.0), st.floats(2.0**-64, 2.0**64).flatmap(lambda x: st.sampled_from([x, -x])))


def _chunk(ws: list[int]) -> bytes:
    return np.array(ws, dtype="<u4").tobytes()


@st.composite
def cases(draw: st.DrawFn) -> tuple[Predictor, tuple[float, ...], bytes, list[bytes]]:
    predictor = draw(st.sampled_from(list(Predictor)))
    shape = predict.SHAPES[predictor]
    n = draw(st.integers(1, 64))
    raw = _chunk(draw(st.lists(words, min_size=n, max_size=n)))
    bases = [_chunk(draw(st.lists(words, min_size=n, max_size=n))) for _ in range(shape.bases)]
    coefficients = tuple(draw(st.lists(coefficient, min_size=shape.coefficients, max_size=shape.coefficients)))
    return predictor, coefficients, raw, bases


def _decode(data: bytes, bases: dict[str, bytes], length: int) -> bytes:
    return decode(data, Kind.CHUNK, 1 << 28, expected_len=length, fetch_base=lambda b, n: bases[b])


def _encode(
    predictor: Predictor, coefficients: tuple[float, ...], raw: bytes, bases: list[bytes]
) -> tuple[bytes, dict[str, bytes]]:
    ids = tuple(chunk_id(b + bytes([i])) for i, b in enumerate(bases))  # distinct even for equal bytes
    data = encode_predicted(raw, 1, ids, bases, predictor, coefficients, than=1 << 30)
    assert data is not None
    return data, dict(zip(ids, bases))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_any_float32_input_round_trips_exactly(case: tuple[Predictor, tuple[float, ...], bytes, list[bytes]]) -> None:
    predictor, coefficients, raw, bases = case
    data, by_id = _encode(predictor, coefficients, raw, bases)
    assert parse_header(data).encoding == Encoding.PREDICTED
    assert delta_bases(data[:BASES_PREFIX_SIZE]) == tuple(by_id)
    assert _decode(data, by_id, len(raw)) == raw


@settings(max_examples=200, deadline=None)
@given(cases())
def test_prediction_is_deterministic_and_never_subnormal_nan_or_inf(
    case: tuple[Predictor, tuple[float, ...], bytes, list[bytes]],
) -> None:
    predictor, coefficients, _, bases = case
    first = predict.predict(predictor, coefficients, bases)
    again = predict.predict(predictor, coefficients, [bytes(b) for b in bases])
    assert np.array_equal(first, again)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(predict, "_BLOCK", 5)  # computed in blocks: the same bits
        assert np.array_equal(first, predict.predict(predictor, coefficients, bases))
    exponent = first & 0x7F800000
    assert not ((exponent == 0) & (first != 0)).any()  # no subnormal, no -0
    assert not (exponent == 0x7F800000).any()  # no infinity, no NaN


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=32), coefficient, coefficient)
def test_weight_prediction_is_the_formula_evaluated_in_order(values: list[float], c0: float, c1: float) -> None:
    """Predictor 2 against an independent scalar evaluation of docs/format.md's formula."""
    w = np.array(values, dtype="<f4")
    m = w[::-1].copy()
    v = np.abs(w) + np.float32(1.0)
    c2 = 1e-8
    got = predict.predict(Predictor.ADAM_WEIGHT, (c0, c1, c2), [w.tobytes(), m.tobytes(), v.tobytes()])

    def to32(x: float) -> float:
        if not np.isfinite(x) or abs(x) < 2.0**-126:
            return 0.0
        with np.errstate(over="ignore"):
            r = float(np.float32(x))
        return r if np.isfinite(r) else 0.0

    def zeroed(x: np.float32) -> float:  # step 1: subnormal inputs are +0
        return 0.0 if abs(float(x)) < 2.0**-126 else float(x)

    want = [
        to32(c0 * to32(zeroed(a) + c1 * (zeroed(b) / (float(np.sqrt(zeroed(c))) + c2)))) for a, b, c in zip(w, m, v)
    ]
    assert got.tolist() == np.array(want, dtype="<f4").view("<u4").tolist()


def _adamw_states(width: int, snapshots: int, steps_between: int, loss_scale: float = 1.0) -> list[list[bytes]]:
    """(weight, exp_avg, exp_avg_sq) of a Linear layer's weight after every ``steps_between``
    AdamW steps, as raw float32 bytes."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    layer = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    states = []
    for _ in range(snapshots):
        for _ in range(steps_between):
            (loss_scale * layer(torch.randn(8, width)).square().mean()).backward()
            opt.step()
            opt.zero_grad()
        moments = opt.state[layer.weight]
        states.append([t.detach().numpy().tobytes() for t in (layer.weight, moments["exp_avg"], moments["exp_avg_sq"])])
    return states


def test_fit_recovers_an_adamw_step_and_beats_a_plain_delta() -> None:
    """Coefficients fitted on real AdamW state predict most elements exactly."""
    states = _adamw_states(256, 8, 1)
    (w1, m1, v1), (w2, m2, v2) = states[-2], states[-1]
    for predictor, target, bases in (
        (Predictor.ADAM_WEIGHT, w1, [w2, m2, v2]),
        (Predictor.ADAM_SECOND_MOMENT, v1, [v2, m2, m1]),
    ):
        coefficients = predict.fit(predictor, target, bases)
        assert coefficients is not None
        exact = (predict.predict(predictor, coefficients, bases) == np.frombuffer(target, "<u4")).mean()
        data, by_id = _encode(predictor, coefficients, target, bases)
        plain = encode_chunk(target, 1, 4, chunk_id(bases[0]), bases[0], allowed=frozenset({Encoding.DELTA}))
        assert exact > (0.6 if predictor == Predictor.ADAM_WEIGHT else 0.2), (predictor, exact)
        assert len(data) < 0.5 * len(plain), (predictor, len(data) / len(target))
        assert _decode(data, by_id, len(target)) == target


def _valid() -> tuple[bytes, dict[str, bytes], bytes]:
    rng = np.random.default_rng(1)
    bases = [rng.random(64, dtype=np.float32).tobytes() for _ in range(3)]
    raw = rng.random(64, dtype=np.float32).tobytes()
    data, by_id = _encode(Predictor.ADAM_WEIGHT, (1.0, 0.5, 0.0), raw, bases)
    return data, by_id, raw


def test_damaged_predicted_objects_are_refused() -> None:
    data, by_id, raw = _valid()
    at = HEADER_SIZE + 1 + 3 * 32  # the predictor byte
    cases = {
        "names 0 bases": data[:HEADER_SIZE] + b"\x00" + data[HEADER_SIZE + 1 :],
        "names 5 bases": data[:HEADER_SIZE] + b"\x05" + data[HEADER_SIZE + 1 :],
        "unknown predictor": data[:at] + b"\x09" + data[at + 1 :],
        "takes 3 bases": data[:HEADER_SIZE] + b"\x02" + data[HEADER_SIZE + 1 :],
        "outside 0 or": data[: at + 1] + struct.pack("<d", float("nan")) + data[at + 9 :],
        "too short": data[: HEADER_SIZE + 40],
    }
    for bad in cases.values():
        with pytest.raises(IntegrityError):
            _decode(bad, by_id, len(raw))
    tiny = data[: at + 1] + struct.pack("<d", 2.0**-80) + data[at + 9 :]
    with pytest.raises(IntegrityError, match="outside 0 or"):
        _decode(tiny, by_id, len(raw))
    with pytest.raises(IntegrityError, match="without access"):
        decode(data, Kind.CHUNK, 1 << 28, expected_len=len(raw))


def test_a_base_of_the_wrong_length_is_refused() -> None:
    data, by_id, raw = _valid()
    short = {k: v[:-4] for k, v in by_id.items()}
    with pytest.raises(IntegrityError, match="decoded to"):
        _decode(data, short, len(raw))


def test_encoder_declines_what_cannot_pay_or_is_not_float32() -> None:
    rng = np.random.default_rng(2)
    bases = [rng.random(64, dtype=np.float32).tobytes() for _ in range(3)]
    ids = tuple(chunk_id(b) for b in bases)
    assert encode_predicted(b"\x00" * 255, 1, ids, [b[:255] for b in bases], 2, (1.0, 1.0, 0.0), 1 << 30) is None
    noise = rng.random(64, dtype=np.float32).tobytes()
    assert encode_predicted(noise, 1, ids, bases, 2, (1.0, 1.0, 0.0), than=64) is None


def test_fit_finds_epsilon_when_gradients_are_as_small_as_it() -> None:
    """Gradients of ~1e-8 (as in scripts/bench_dcp.py): sqrt(v) is of the order of AdamW's
    bias-corrected epsilon, which then decides most elements. At step 4 the step-1 epsilon
    predicts almost nothing exactly; the fit must still find step 4's (a probe of three points
    once gave up on every weight chunk of that benchmark), and a later chunk of the same step
    takes the coefficients as a hint."""
    states = _adamw_states(256, 4, 1, loss_scale=3e-6)
    (w3, _m3, _v3), (w4, m4, v4) = states[-2], states[-1]
    assert 1e-10 < np.median(np.sqrt(np.frombuffer(v4, "<f4"))) < 1e-9
    bases = [w4, m4, v4]
    coefficients = predict.fit(Predictor.ADAM_WEIGHT, w3, bases)
    assert coefficients is not None
    exact = (predict.predict(Predictor.ADAM_WEIGHT, coefficients, bases) == np.frombuffer(w3, "<u4")).mean()
    assert exact > 0.4, exact
    assert predict.fit(Predictor.ADAM_WEIGHT, w3, bases, hint=coefficients) == coefficients
    # A hint that does not fit is only a hint: the search still runs.
    assert predict.fit(Predictor.ADAM_WEIGHT, w3, bases, hint=(1.0, 1e-3, 1e-8)) == coefficients


def test_a_hint_that_does_as_well_as_where_it_was_fitted_spares_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where few elements come out exact at all (tiny gradients: epsilon decides), a chunk of the
    same step takes the coefficients another chunk's search found when they predict about as
    much of its sample exactly (the search cost ~250 ms a 1 MiB chunk and found the same)."""
    states = _adamw_states(256, 4, 1, loss_scale=3e-6)
    (w3, _m3, _v3), (w4, m4, v4) = states[-2], states[-1]
    found = predict.fit_scored(Predictor.ADAM_WEIGHT, w3, [w4, m4, v4])
    assert found is not None and found[1] > 0.4
    monkeypatch.setattr(predict, "_GOOD_ENOUGH", 1.01)  # as where under 97% come out exact anywhere
    monkeypatch.setattr(predict, "_fit_weight", lambda sample: pytest.fail("searched although the hint fits"))
    assert predict.fit_scored(Predictor.ADAM_WEIGHT, w3, [w4, m4, v4], hint=found) == found
    monkeypatch.undo()
    # A hint that does much worse here than where it was fitted is only a hint: the search runs.
    assert predict.fit_scored(Predictor.ADAM_WEIGHT, w3, [w4, m4, v4], hint=((1.0, 1e-3, 1e-8), found[1])) == found


def test_fit_gives_up_on_weights_many_steps_apart() -> None:
    """Checkpoints 20 steps apart: the older weights are no function of the newer state, and the
    fit says so after a cheap probe instead of searching (compaction then keeps a plain delta)."""
    states = _adamw_states(128, 2, 20)
    assert predict.fit(Predictor.ADAM_WEIGHT, states[0][0], states[1]) is None


@settings(max_examples=200, deadline=None)
@given(cases())
def test_parts_xor_the_prediction_is_the_decode(case: tuple[Predictor, tuple[float, ...], bytes, list[bytes]]) -> None:
    """What compaction's check relies on to reuse the prediction it encoded with: an object's
    decode is its parsed residual XOR ``predict`` of its parsed predictor, coefficients and bases."""
    predictor, coefficients, raw, bases = case
    guess = predict.predict(predictor, coefficients, bases)
    data, by_id = _encode(predictor, coefficients, raw, bases)
    assert data == encode_predicted(raw, 1, tuple(by_id), bases, predictor, coefficients, 1 << 30, guess=guess)
    parts = predicted_parts(data, len(raw))
    assert parts.same_prediction(tuple(by_id), predictor, coefficients)
    assert (parts.residual.view("<u4") ^ guess).tobytes() == _decode(data, by_id, len(raw)) == raw


def test_compaction_check_refuses_what_does_not_decode_to_the_chunk() -> None:
    """The check after a predicted delta is encoded (encoding._check_predicted, which reuses the
    encode's prediction instead of predicting again) refuses an object naming other coefficients
    (-0.0 for 0.0 included), other bases or another predictor, a damaged residual, and a
    prediction that is not the object's."""
    from ckstore.compaction.encoding import _check_predicted
    from ckstore.compaction.pairing import Prediction

    (w3, _, _), (w4, m4, v4) = _adamw_states(256, 2, 1)
    coefficients = predict.fit(Predictor.ADAM_WEIGHT, w3, [w4, m4, v4])
    assert coefficients is not None
    bases = [w4, m4, v4]
    ids = tuple(chunk_id(b) for b in bases)
    guess = predict.predict(Predictor.ADAM_WEIGHT, coefficients, bases)
    data = encode_predicted(w3, 1, ids, bases, Predictor.ADAM_WEIGHT, coefficients, 1 << 30, guess=guess)
    assert data is not None
    p = Prediction(Predictor.ADAM_WEIGHT, ids, ids, None)
    _check_predicted("x", data, w3, p, coefficients, guess)  # the real one passes
    with pytest.raises(IntegrityError, match="another prediction"):
        _check_predicted("x", data, w3, p, (coefficients[0], coefficients[1], coefficients[2] * 2), guess)
    with pytest.raises(IntegrityError, match="another prediction"):
        _check_predicted("x", data, w3, Prediction(Predictor.ADAM_WEIGHT, ids[::-1], ids, None), coefficients, guess)
    with pytest.raises(IntegrityError, match="another prediction"):
        _check_predicted("x", data, w3, Prediction(Predictor.ADAM_SECOND_MOMENT, ids, ids, None), coefficients, guess)
    zero = predict.predict(Predictor.ADAM_WEIGHT, (coefficients[0], 0.0, coefficients[2]), bases)
    signed = encode_predicted(
        w3, 1, ids, bases, Predictor.ADAM_WEIGHT, (coefficients[0], 0.0, coefficients[2]), 1 << 30, guess=zero
    )
    assert signed is not None
    with pytest.raises(IntegrityError, match="another prediction"):
        _check_predicted("x", signed, w3, p, (coefficients[0], -0.0, coefficients[2]), zero)
    damaged = bytearray(data)
    damaged[-7] ^= 0x10
    with pytest.raises(IntegrityError, match="x"):
        _check_predicted("x", bytes(damaged), w3, p, coefficients, guess)
    with pytest.raises(IntegrityError, match="does not decode to its bytes"):
        _check_predicted("x", data, w3, p, coefficients, guess ^ np.uint32(1))


def test_a_second_moment_hint_a_fresh_fit_cannot_beat_spares_the_full_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hint that falls short of its own chunk's score (the slack) is still taken when a fit on
    an eighth of the sample does no better there: the full fit would find the same step's
    coefficients again (~40 ms a 1 MiB chunk, 28 chunks of a DCP benchmark step)."""
    (_, m1, v1), (_, m2, v2) = _adamw_states(256, 8, 1)[-2:]
    bases = [v2, m2, m1]
    found = predict.fit_scored(Predictor.ADAM_SECOND_MOMENT, v1, bases)
    assert found is not None
    fits: list[int] = []
    original = predict._fit_second_moment_on

    def counted(sample: predict._Sample) -> tuple[int, tuple[float, ...]] | None:
        fits.append(len(sample.bits))
        return original(sample)

    monkeypatch.setattr(predict, "_fit_second_moment_on", counted)
    # As if these coefficients had predicted far more of another chunk: the slack is missed.
    claimed = (found[0], found[1] + 0.1)
    assert predict.fit_scored(Predictor.ADAM_SECOND_MOMENT, v1, bases, hint=claimed) == found
    assert len(fits) == 1 and fits[0] < predict.FIT_SAMPLE  # the eighth's probe only

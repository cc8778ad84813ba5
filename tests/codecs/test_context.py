"""The context-sorted delta (codec encoding 5, codecs/context.py): bit-exact round trips on every
dtype and on the values that break naive float handling (NaN payloads, +-0, subnormals, inf),
all-equal, tiny and odd-length chunks, with the compiled kernels and with the numpy fallback
(identical bytes); smaller than a plain delta where the exponent tells how far a value moved;
hostile bodies refused; only compaction and repack may write it."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckstore.codecs import context
from ckstore.codecs.objects import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    DeltaOp,
    Encoding,
    Kind,
    decode,
    delta_bases,
    encode_chunk,
    encode_delta,
    parse_header,
)
from ckstore.codecs.planes import PLANE, PlaneMode
from ckstore.errors import IntegrityError
from ckstore.format.settings import CONTEXT_VERSION, REPO_FORMAT_VERSION, EncodingSettings, version_for

BASE_ID = "cd" * 32
ONLY_CONTEXT = frozenset({Encoding.CONTEXT})
# Every dtype a checkpoint holds, by its bit pattern (bf16 has no numpy dtype: its patterns are
# generated as uint16 with the float32 exponent layout).
DTYPES = {
    "float16": np.float16,
    "bfloat16": "bf16",
    "float32": np.float32,
    "float64": np.float64,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
}
SPECIAL32 = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1e-40, 3.4e38, 1.0, -1.0]


def _decode(data: bytes, base: bytes) -> bytes:
    def fetch(oid: str, n: int) -> bytes:
        assert oid == BASE_ID and n == len(base)
        return base

    return decode(data, Kind.CHUNK, 1 << 28, expected_len=None, fetch_base=fetch)


def _values(dtype: str, n: int, seed: int, special: float) -> np.ndarray:
    """``n`` values of ``dtype`` as bytes (uint8), a share ``special`` of them special values."""
    rng = np.random.default_rng(seed)
    kind = DTYPES[dtype]
    if kind == "bf16":
        bits = (rng.standard_normal(n).astype(np.float32) * 0.05).view(np.uint32) >> 16
        out = bits.astype(np.uint16)
        specials = np.array(SPECIAL32, np.float32).view(np.uint32) >> 16
        pick = rng.random(n) < special
        out[pick] = specials[rng.integers(0, len(specials), int(pick.sum()))].astype(np.uint16)
        return out.view(np.uint8)
    if np.issubdtype(kind, np.integer):
        return rng.integers(-1000, 1000, n).astype(kind).view(np.uint8)
    out = (rng.standard_normal(n) * 0.05).astype(kind)
    pick = rng.random(n) < special
    with np.errstate(over="ignore"):
        out[pick] = np.array(SPECIAL32, dtype=np.float64).astype(kind)[rng.integers(0, len(SPECIAL32), int(pick.sum()))]
    if kind != np.float16:  # NaNs with payloads and both signs: bit patterns, not values, must survive
        width = np.dtype(kind).itemsize
        ints = out.view(f"<u{width}")
        nan = rng.random(n) < special / 2
        ints[nan] = (np.iinfo(f"<u{width}").max >> 1) - rng.integers(0, 1000, int(nan.sum())).astype(f"<u{width}")
    return out.view(np.uint8)


def _moved(raw: np.ndarray, width: int, seed: int, share: float) -> np.ndarray:
    """The base: ``raw`` with a share of its elements moved by a few units in the last place."""
    rng = np.random.default_rng(seed)
    if width == 1:
        return raw ^ (rng.random(raw.size) < share).astype(np.uint8)
    ints = raw.view(f"<u{width}").copy()
    pick = rng.random(ints.size) < share
    ints[pick] += rng.integers(-300, 300, int(pick.sum())).astype(f"<i{width}").view(f"<u{width}")
    return ints.view(np.uint8)


@pytest.fixture(params=["compiled", "numpy"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with numba's kernels and with the numpy fallback (no numba installed)."""
    if request.param == "numpy":
        monkeypatch.setattr(context, "_KERNELS", [None])
    else:
        assert context._kernels() is not None  # numba is a dependency: the fast path is tested
    return str(request.param)


def _sorted_planes(data: bytes) -> list[int]:
    """The planes of a context-sorted delta stored in context order."""
    width = data[HEADER_SIZE + 33]
    table = HEADER_SIZE + 34
    return [i for i in range(width) if PLANE.unpack_from(data, table + i * PLANE.size)[0] & PlaneMode.SORTED]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(0, 5000),
    seed=st.integers(0, 2**32 - 1),
    special=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
    share=st.sampled_from([0.0, 0.1, 1.0]),
    op=st.sampled_from(list(DeltaOp)),
)
def test_round_trip_every_dtype_with_special_values(
    kernels: str, dtype: str, n: int, seed: int, special: float, share: float, op: DeltaOp
) -> None:
    raw = _values(dtype, n, seed, special)
    width = 2 if DTYPES[dtype] == "bf16" else np.dtype(DTYPES[dtype]).itemsize
    base = _moved(raw, width, seed + 1, share).tobytes()
    data = encode_chunk(raw.tobytes(), 1, width, BASE_ID, base, allowed=ONLY_CONTEXT, ops=(op,))
    assert len(data) <= raw.size + HEADER_SIZE
    # A context-sorted delta with no plane sorted is written as the plain delta it equals.
    possible = {Encoding.CONTEXT, Encoding.DELTA, Encoding.RAW} if width in context.WIDTHS and n else {Encoding.RAW}
    assert parse_header(data).encoding in possible
    if parse_header(data).encoding == Encoding.CONTEXT:
        assert _sorted_planes(data)
    assert _decode(data, base) == raw.tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(0, 5000),
    seed=st.integers(0, 2**32 - 1),
    special=st.sampled_from([0.0, 0.01, 1.0]),
    share=st.sampled_from([0.0, 0.1, 1.0]),
    op=st.sampled_from(list(DeltaOp)),
)
def test_planes_are_joined_alike_by_the_kernels_and_by_numpy(
    kernels: str, dtype: str, n: int, seed: int, special: float, share: float, op: DeltaOp
) -> None:
    """Once the kernels are loaded, byte-grouped chunks and plain deltas (encodings 2 and 3) of 2-,
    4- and 8-byte elements are joined from their planes (and with the base) by them, in one pass,
    the zigzag difference wrapping at the element width; without them by numpy: the same bytes
    either way, NaN payloads, +-0, subnormals and wrap-arounds included."""
    raw = _values(dtype, n, seed, special)
    width = 2 if DTYPES[dtype] == "bf16" else np.dtype(DTYPES[dtype]).itemsize
    base = _moved(raw, width, seed + 1, share).tobytes()
    grouped = encode_chunk(raw.tobytes(), 1, width, allowed=frozenset({Encoding.GROUPED}))
    assert decode(grouped, Kind.CHUNK, 1 << 28) == raw.tobytes()
    data = encode_chunk(raw.tobytes(), 1, width, BASE_ID, base, allowed=frozenset({Encoding.DELTA}), ops=(op,))
    assert _decode(data, base) == raw.tobytes()
    if width in context.JOIN_WIDTHS and n:  # every element wraps: the residual of base 0x80.. against 0x7f..
        wrapped = np.full(n * width, 0xFF, np.uint8).tobytes()
        data = encode_chunk(
            wrapped, 1, width, BASE_ID, b"\x00" * len(wrapped), allowed=frozenset({Encoding.DELTA}), ops=(op,)
        )
        assert _decode(data, b"\x00" * len(wrapped)) == wrapped


@settings(max_examples=30, deadline=None)
@given(width=st.sampled_from(context.WIDTHS), n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
def test_compiled_kernels_and_numpy_agree_byte_for_byte(width: int, n: int, seed: int) -> None:
    """The numpy fallback is the specification in code (format.md's rule); the kernels must
    permute exactly as it does, both ways, on any bytes (every key, every capped byte above)."""
    rng = np.random.default_rng(seed)
    residual = rng.integers(0, 256, n * width, dtype=np.uint8) >> rng.integers(0, 8, n * width, dtype=np.uint8)
    base = rng.integers(0, 256, n * width, dtype=np.uint8).tobytes()
    assert context._kernels() is not None
    compiled = [context.sorted_plane(residual, base, width)(p) for p in range(width)]
    saved = list(context._KERNELS)
    context._KERNELS[:] = [None]
    try:
        plain = [context.sorted_plane(residual, base, width)(p) for p in range(width)]
        back_numpy = context.unsort_planes(dict(enumerate(plain)), base, width, np.empty_like(residual))
    finally:
        context._KERNELS[:] = saved
    assert [c.tolist() for c in compiled] == [p.tolist() for p in plain]
    back = context.unsort_planes(dict(enumerate(compiled)), base, width, np.empty_like(residual))
    assert back.tolist() == residual.tolist() == back_numpy.tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=3000), width=st.sampled_from([1, 2, 3, 4, 8]), seed=st.integers(0, 1000))
def test_arbitrary_and_odd_length_bytes_round_trip(kernels: str, raw: bytes, width: int, seed: int) -> None:
    """Lengths that are no whole number of elements (and widths without a context) fall back."""
    base = bytes(np.random.default_rng(seed).permutation(np.frombuffer(raw, np.uint8))) if raw else b""
    data = encode_chunk(raw, 1, width, BASE_ID, base, allowed=ONLY_CONTEXT | {Encoding.GROUPED})
    assert _decode(data, base) == raw


@pytest.mark.parametrize("width", context.WIDTHS)
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_tiny_and_all_equal_chunks(kernels: str, width: int, n: int) -> None:
    for raw, base in [
        (b"\x00" * (n * width), b"\x00" * (n * width)),  # all zero, equal
        (b"\x7f" * (n * width), b"\x80" * (n * width)),  # all equal, every byte differs
        (b"\x01" * (n * width), b"\x00" * (n * width)),
    ]:
        data = encode_chunk(raw, 1, width, BASE_ID, base, allowed=ONLY_CONTEXT)
        assert _decode(data, base) == raw
    big = b"\x3f\x80\x00\x00" * (1 << 14)
    data = encode_chunk(big, 1, 4, BASE_ID, big, allowed=ONLY_CONTEXT)
    # All equal: ~nothing stored, and no plane is worth sorting, so it is a plain delta.
    assert parse_header(data).encoding == Encoding.DELTA and len(data) < 200
    assert _decode(data, big) == big


def _adam_like(dtype: type, n: int, seed: int) -> tuple[bytes, bytes]:
    """A weight tensor and the same tensor some optimizer steps earlier: every value moved by about
    the same absolute amount, so the move in units in the last place depends on the exponent."""
    rng = np.random.default_rng(seed)
    new = (rng.standard_normal(n) * 0.05).astype(dtype)
    old = (new.astype(np.float64) + 1e-4 * np.tanh(rng.standard_normal(n))).astype(dtype)
    return old.tobytes(), new.tobytes()


def _bf16_like(n: int, seed: int) -> tuple[bytes, bytes]:
    """``_adam_like`` in bfloat16 (float32 patterns cut to their top 16 bits, as torch rounds
    toward zero): 8 exponent bits, the key's whole major part."""
    old, new = (np.frombuffer(x, "<u4") >> 16 for x in _adam_like(np.float32, n, seed))
    return old.astype("<u2").tobytes(), new.astype("<u2").tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_context_is_smaller_than_a_plain_delta_where_the_exponent_tells(kernels: str, dtype: str) -> None:
    raw, base = _adam_like(np.float32, 1 << 16, 3) if dtype == "float32" else _bf16_like(1 << 16, 3)
    width = 4 if dtype == "float32" else 2
    plain = encode_chunk(raw, 1, width, BASE_ID, base, allowed=frozenset({Encoding.DELTA}))
    sorted_ = encode_chunk(raw, 1, width, BASE_ID, base, allowed=ONLY_CONTEXT)
    assert parse_header(sorted_).encoding == Encoding.CONTEXT
    assert len(sorted_) < 0.97 * len(plain)
    assert _decode(sorted_, base) == raw
    # Only planes whose sorted form saves at least SORT_GAIN bytes an element are sorted.
    assert 0 < len(_sorted_planes(sorted_)) <= width


def test_a_short_read_decodes_with_numpy_and_never_loads_numba(tmp_path: Path) -> None:
    """numba's first use in a process costs about a second of CPU (its import and compiler set-up),
    more than a read of a few old chunks takes: such a process decodes them with numpy."""
    raw, base = _adam_like(np.float32, 1 << 16, 3)
    data = encode_chunk(raw, 1, 4, BASE_ID, base, allowed=ONLY_CONTEXT)
    assert _sorted_planes(data)
    for name, content in [("chunk", data), ("base", base), ("raw", raw)]:
        (tmp_path / name).write_bytes(content)
    script = (
        "import sys; from pathlib import Path; from ckstore.codecs.objects import Kind, decode\n"
        f"d, b, r = (Path({str(tmp_path)!r}, n).read_bytes() for n in ('chunk', 'base', 'raw'))\n"
        "out = decode(d, Kind.CHUNK, 1 << 28, len(r), lambda oid, n: b)\n"
        "print(out == r, 'numba' in sys.modules)\n"
    )
    tree = str(Path(context.__file__).parents[2])  # this checkout's ckstore, not another install
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == ["True", "False"]


def test_a_long_decode_switches_to_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a process has un-sorted as many elements with numpy as numba's set-up is worth, it
    loads the kernels (and later chunks decode with them, to the same bytes)."""
    raw, base = _adam_like(np.float32, 1 << 12, 5)
    data = encode_chunk(raw, 1, 4, BASE_ID, base, allowed=ONLY_CONTEXT)
    planes = len(_sorted_planes(data))
    assert planes
    monkeypatch.setattr(context, "_KERNELS", [])  # a process that has not loaded them
    monkeypatch.setattr(context, "_NUMPY_DECODED", [0])
    monkeypatch.setattr(context, "NUMPY_DECODE_ELEMENTS", 2 * planes * (1 << 12))
    for _ in range(2):
        assert _decode(data, base) == raw
        assert context._KERNELS == []
    assert _decode(data, base) == raw
    assert context._KERNELS and context._KERNELS[0] is not None


def test_a_plane_is_sorted_only_where_that_pays() -> None:
    """The low byte of float16 elements that moved by random amounts is noise in any order: it
    stays in element order (stored raw), while the top plane, whose residual depends on the
    exponent, is sorted."""
    rng = np.random.default_rng(9)
    new = (rng.standard_normal(1 << 15) * 0.05).astype(np.float16)
    ints = new.view("<u2").copy()
    ints ^= rng.integers(0, 256, ints.size).astype("<u2")  # every low byte random
    small = np.abs(new) < 0.01  # small values also move in the byte above
    ints[small] ^= (rng.integers(0, 4, int(small.sum())) << 8).astype("<u2")
    raw, base = ints.tobytes(), new.tobytes()
    data = encode_chunk(raw, 1, 2, BASE_ID, base, allowed=ONLY_CONTEXT)
    assert parse_header(data).encoding == Encoding.CONTEXT
    assert _sorted_planes(data) == [1]
    assert _decode(data, base) == raw


def test_encode_delta_offers_the_context_only_when_allowed() -> None:
    raw, base = _adam_like(np.float32, 1 << 18, 4)  # sampled choice: longer than EXHAUSTIVE_MAX
    plain = encode_delta(raw, 1, 4, BASE_ID, base, len(raw))
    assert plain is not None and parse_header(plain).encoding == Encoding.DELTA
    best = encode_delta(raw, 1, 4, BASE_ID, base, len(raw), frozenset({Encoding.DELTA, Encoding.CONTEXT}))
    assert best is not None and parse_header(best).encoding == Encoding.CONTEXT and len(best) < len(plain)
    assert delta_bases(best) == (BASE_ID,)
    assert _decode(best, base) == raw


def test_commits_never_write_it_and_compaction_may_after_an_upgrade() -> None:
    assert version_for(Encoding.CONTEXT) == CONTEXT_VERSION == REPO_FORMAT_VERSION
    for version in range(2, REPO_FORMAT_VERSION + 1):
        settings_ = EncodingSettings(repo_version=version)
        assert Encoding.CONTEXT not in settings_.allowed  # the commit path: training never waits on it
        assert Encoding.CONTEXT in settings_.allowed_off_loop
    assert Encoding.CONTEXT not in EncodingSettings(repo_version=1).allowed_off_loop
    raw, base = _adam_like(np.float32, 4096, 5)
    assert parse_header(encode_chunk(raw, 1, 4, BASE_ID, base)).encoding != Encoding.CONTEXT  # not by default


def _context_object(width: int = 4, n: int = 1024) -> tuple[bytes, bytes, bytes]:
    raw, base = _adam_like({2: np.float16, 4: np.float32, 8: np.float64}[width], n, 6)
    data = encode_chunk(raw, 1, width, BASE_ID, base, allowed=ONLY_CONTEXT)
    assert parse_header(data).encoding == Encoding.CONTEXT
    return data, raw, base


def test_hostile_bodies_are_refused_before_the_base_is_fetched() -> None:
    data, raw, base = _context_object()
    plain = encode_chunk(raw, 1, 4, BASE_ID, base, allowed=frozenset({Encoding.DELTA}))
    table = HEADER_SIZE + 34
    body = bytearray(data)
    width_at = HEADER_SIZE + 33
    cases = {
        "truncated": bytes(data[:-5]),
        "trailing": data + b"\x00",
        "width 1": bytes(body[:width_at]) + bytes([1]) + bytes(body[width_at + 1 :]),
        "width 3": bytes(body[:width_at]) + bytes([3]) + bytes(body[width_at + 1 :]),
        "bad op": bytes(body[: width_at - 1]) + bytes([9]) + bytes(body[width_at:]),
        "short": HEADER.pack(MAGIC, 1, Kind.CHUNK, Encoding.CONTEXT, 0, len(raw)) + b"\x01" * 10,
        "plane mode 4": bytes(body[:table]) + bytes([4]) + bytes(body[table + 1 :]),
        # The sorted flag means nothing in a plain delta: refused there.
        "sorted flag in a plain delta": plain[:table] + bytes([plain[table] | PlaneMode.SORTED]) + plain[table + 1 :],
    }
    fetched = []
    for name, bad in cases.items():
        with pytest.raises(IntegrityError):
            decode(bad, Kind.CHUNK, 1 << 28, fetch_base=lambda oid, n: fetched.append(name) or base)
    assert fetched == []  # every malformed body fails before its base is read
    with pytest.raises(IntegrityError, match="without access to its base"):
        decode(data, Kind.CHUNK, 1 << 28)
    with pytest.raises(IntegrityError, match="base decoded to"):
        decode(data, Kind.CHUNK, 1 << 28, fetch_base=lambda oid, n: base[:-4])


def test_a_wrong_base_decodes_to_other_bytes_not_an_error_the_hash_catches_it() -> None:
    """The permutation comes from the base: a different base of the right length decodes to
    different bytes (the caller's hash check names the object), never out of bounds."""
    data, raw, base = _context_object()
    other = bytes(reversed(base))
    assert _decode_with(data, other) != raw


def _decode_with(data: bytes, base: bytes) -> bytes:
    return decode(data, Kind.CHUNK, 1 << 28, fetch_base=lambda oid, n: base)


def test_sort_key_is_the_documented_rule(kernels: str) -> None:
    """docs/format.md: the key of element k in plane w-1 is 4 * E[k], in plane i < w-1
    4 * E[k] + min(residual byte i+1, 3), where E[k] is the 8 bits below the sign bit of base
    element k; ties in element order."""
    # float32 bases: 1.0 (exponent 127), -2.0 (128, sign set), 0.5 (126), 1.5 (127), 0 (0)
    base = np.array([1.0, -2.0, 0.5, 1.5, 0.0], "<f4").view(np.uint8)
    assert context.sort_key(base, 4, None).tolist() == [508, 512, 504, 508, 0]
    higher = np.array([0, 7, 2, 3, 255], np.uint8)
    assert context.sort_key(base, 4, higher).tolist() == [508, 515, 506, 511, 3]
    residual = np.arange(20, dtype=np.uint8)  # element k's bytes: 4k .. 4k + 3
    plane = context.sorted_plane(residual, base.tobytes(), 4)
    assert plane(3).tolist() == [19, 11, 3, 15, 7]  # keys 0, 504, 508, 508 (ties in order), 512
    # plane 2: the byte above is 4k + 3 (capped: 3 for all), so the order is the same
    assert plane(2).tolist() == [18, 10, 2, 14, 6]
    planes = {p: plane(p) for p in range(4)}
    assert context.unsort_planes(planes, base.tobytes(), 4, np.empty(20, np.uint8)).tolist() == residual.tolist()


def test_plane_count_must_match_the_width() -> None:
    data, raw, base = _context_object(width=2)
    header = bytearray(data[:HEADER_SIZE])
    struct.pack_into("<Q", header, 8, len(raw) + 2)  # a raw length the planes do not add up to
    with pytest.raises(IntegrityError):
        _decode_with(bytes(header) + data[HEADER_SIZE:], base)

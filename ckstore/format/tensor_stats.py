"""Per-tensor statistics recorded in a manifest (format.md section 5.1): pure numpy, no I/O.

A tensor's bytes arrive chunk by chunk (commit hashes them on worker threads), so the figures are
built from per-chunk partial sums that combine by addition (and max), whatever the chunk order.
Norms count only finite elements, so the recorded numbers are always valid JSON; the non-finite
elements are counted instead.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from ckstore.format.dtypes import NUMPY_TYPES

# Real numeric types numpy can read (floats and integers: a view of the one dtype table, as type
# strings: numpy is imported where figures are computed, not here, since manifest.py imports this
# module and reading commands (log, show) start without numpy, tests/cli/test_startup.py). BF16, which
# numpy lacks, is widened by hand.
_VIEWS = {code: t for code, t in NUMPY_TYPES.items() if t.lstrip("<")[0] in "fiu"}
NUMERIC_DTYPES = frozenset((*_VIEWS, "BF16"))


def item_size(dtype: str) -> int:
    return 2 if dtype == "BF16" else int(_VIEWS[dtype][-1])


def as_numbers(data: bytes | memoryview, dtype: str) -> np.ndarray:
    """The elements of a little-endian buffer as numbers (bf16 widened exactly to float32)."""
    import numpy as np

    if dtype == "BF16":
        widened = np.frombuffer(data, dtype=np.uint16).astype(np.uint32)
        np.left_shift(widened, 16, out=widened)  # in place: a second array cost as much as the shift
        return widened.view(np.float32)
    return np.frombuffer(data, dtype=np.dtype(_VIEWS[dtype]))


@dataclass(frozen=True)
class TensorStats:
    """What a manifest records about one tensor.

    ``l2`` and ``absmax`` are over the finite elements; ``nonfinite`` counts NaN and ±inf.
    ``change`` is ||t − p|| / ||p|| against the same tensor in the first parent, None where the
    manifest does not know it (format.md 5.1): commit records it only when it is free, for a
    tensor whose chunks are all the parent's (0.0); history/magnitude.py computes the rest.
    """

    l2: float | None  # None: the float64 sum of squares overflowed
    absmax: float | None
    nonfinite: int
    change: float | None = None


@dataclass
class StatsAccumulator:
    """Partial sums for one tensor, fed one chunk at a time (``ChunkStats`` of each chunk).

    A chunk that is the parent's chunk at the same index may be left out (``skip``): a tensor
    whose chunks were all left out has its parent's figures (``result``); where only some were,
    the caller adds their figures before asking (``skipped`` names them).
    """

    sum_sq: float = 0.0
    absmax: float = 0.0
    nonfinite: int = 0
    diff_sq: float = 0.0
    parent_sq: float = 0.0
    comparable: bool = True  # every chunk's difference from the parent's is known
    counted: int = 0  # chunks added
    skipped: list[tuple[str, int]] = field(default_factory=list)  # (id, length) of chunks left out
    parent: TensorStats | None = None  # the parent's figures, when chunks were left out

    def skip(self, chunk_id: str, length: int, parent: TensorStats) -> None:
        self.skipped.append((chunk_id, length))
        self.parent = parent

    def add(self, chunk: ChunkStats) -> None:
        self.counted += 1
        self.sum_sq += chunk.sum_sq
        self.absmax = max(self.absmax, chunk.absmax)
        self.nonfinite += chunk.nonfinite
        if chunk.diff_sq is None or chunk.parent_sq is None:
            self.comparable = False
        else:
            self.diff_sq += chunk.diff_sq
            self.parent_sq += chunk.parent_sq

    def result(self) -> TensorStats:
        if self.skipped and not self.counted and self.parent is not None:
            # Every chunk is the parent's: its figures, and no change (a sum that overflowed has
            # no finite relative change, as relative_change says).
            return replace(self.parent, change=0.0 if self.parent.l2 is not None else None)
        assert not self.skipped, "figures of the skipped chunks must be added first"
        return TensorStats(
            math.sqrt(self.sum_sq),
            self.absmax,
            self.nonfinite,
            relative_change(self.diff_sq, self.parent_sq) if self.comparable else None,
        )


def relative_change(diff_sq: float, parent_sq: float) -> float | None:
    """sqrt(diff_sq / parent_sq), None where that is not a finite number."""
    if not (math.isfinite(diff_sq) and math.isfinite(parent_sq)):
        return None
    if parent_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else None
    return math.sqrt(diff_sq / parent_sq)


@dataclass(frozen=True)
class ChunkStats:
    sum_sq: float
    absmax: float
    nonfinite: int
    diff_sq: float | None  # None: not known without the parent's bytes
    parent_sq: float | None


def _sum_sq_absmax(values: np.ndarray, wide: bool = False) -> tuple[float, float]:
    """Sum of squares and largest magnitude of a chunk.

    Floats of 32 bits or fewer are summed in float32 (sdot keeps several SIMD accumulators: about
    1e-7 relative error per block), block by block (``_blocks``), without a float64 copy; blocks
    are added in float64. ``wide`` (and every other dtype) sums a float64 copy: for float64
    tensors, integers, and a float32 sum that overflowed.
    """
    import numpy as np

    if not values.size:
        return 0.0, 0.0
    if wide or values.dtype != np.float32:
        with np.errstate(all="ignore"):  # NaN and inf are expected here; the caller counts them
            values = values.astype(np.float64)  # also: negating an unsigned or the smallest int wraps
        return float(np.einsum("i,i->", values, values)), float(max(values.max(), -values.min()))
    sum_sq, absmax = 0.0, 0.0
    for block in _blocks(values):
        s, m = _float32_block(block)
        sum_sq, absmax = sum_sq + s, max(absmax, m)
    return sum_sq, absmax


# Elements per pass: a whole 1 MiB fp32 chunk (half a bf16 one). The commit computes figures on
# two pipeline threads at once, and between numpy calls each thread needs the GIL: with 64K-element
# blocks (L2-sized, the fastest on one thread) two threads spent 1.24 CPU ms per MiB of bf16 and
# ran no faster than one, against 0.68 with these (fp32 0.45 -> 0.30; idle, 2 cores). The
# per-thread scratch buffers bf16 and float16 are widened into are reused: a fresh array per
# chunk cost more in page faults than the arithmetic.
_BLOCK = 1 << 18
_scratch = threading.local()


def _blocks(values: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, values.size, _BLOCK):
        yield values[start : start + _BLOCK]


def _buffer(which: int = 0) -> np.ndarray:
    """This thread's scratch buffer number ``which`` (0 or 1), ``_BLOCK`` uint32 elements."""
    import numpy as np

    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = (np.empty(_BLOCK, dtype=np.uint32), np.empty(_BLOCK, dtype=np.uint32))
    return buffers[which]


def _float32_block(block: np.ndarray) -> tuple[float, float]:
    return _sum_sq32(block), float(max(block.max(), -block.min()))


def _sum_sq32(block: np.ndarray) -> float:
    """Sum of squares of a float32 block (at most ``_BLOCK`` elements), accumulated in float32.

    vdot (BLAS sdot) runs in a third of einsum's time here (28 against 84 us for 256 Ki elements,
    idle) with the same order of error (~1e-7 relative); at this size OpenBLAS computes it on the
    calling thread (CPU time equals wall time, measured up to 4 Mi elements)."""
    import numpy as np

    return float(np.vdot(block, block))


def _bf16_sum_sq_absmax(bits: np.ndarray) -> tuple[float, float]:
    """Sum of squares and largest magnitude of bf16 elements (``bits``: their uint16 patterns).

    Read as uint32 words, each holding two elements (little-endian: the later one in the high
    half), masking the low half away and shifting the low one up give both as float32 with no
    widening copy (a square ignores the sign); with the signs cleared, the largest magnitude is the
    largest 16-bit pattern (IEEE order; NaN and inf make the sum non-finite and are handled by the
    caller). Six passes over the words, 0.36-0.45 ms per MiB against 0.5-0.6 for the eight this
    took before (einsum and a separate maximum); one odd element is widened alone."""
    import numpy as np

    sum_sq, top = 0.0, 0
    if bits.size % 2:
        last = np.array([int(bits[-1]) << 16 & 0x7FFF0000], dtype=np.uint32)
        sum_sq, top = _sum_sq32(last.view(np.float32)), int(last[0]) >> 16
        bits = bits[:-1]
    words = bits.view(np.uint32)
    high, low = _buffer(), _buffer(1)
    for block in _blocks(words):
        h, lo = high[: block.size], low[: block.size]
        np.bitwise_and(block, 0xFFFF0000, out=h)
        np.left_shift(block, 16, out=lo)
        sum_sq += _sum_sq32(h.view(np.float32)) + _sum_sq32(lo.view(np.float32))
        np.bitwise_and(block, 0x7FFF7FFF, out=h)
        top = max(top, int(h.view(np.uint16).max()))
    return sum_sq, float(np.array(top << 16, dtype=np.uint32).view(np.float32))


def _float16_sum_sq_absmax(values: np.ndarray) -> tuple[float, float]:
    """float16 has no SIMD reductions in numpy: each block is widened into the scratch buffer."""
    import numpy as np

    sum_sq, absmax = 0.0, 0.0
    scratch = _buffer().view(np.float32)
    for block in _blocks(values):
        wide = scratch[: block.size]
        np.copyto(wide, block)
        s, m = _float32_block(wide)
        sum_sq, absmax = sum_sq + s, max(absmax, m)
    return sum_sq, absmax


def chunk_stats(data: bytes | memoryview, dtype: str, same_as_parent: bool = False) -> ChunkStats:
    """Statistics of one element-aligned chunk of a tensor of ``dtype`` (one of NUMERIC_DTYPES).

    ``same_as_parent``: the parent's chunk at this index is this very chunk (same id), so it adds
    nothing to the difference. A changed chunk's difference needs the parent's bytes, which
    commit does not read (it would cost several times the commit: docs/benchmarks.md).
    """
    import numpy as np

    if dtype == "BF16":
        sum_sq, absmax = _bf16_sum_sq_absmax(np.frombuffer(data, dtype=np.uint16))
    else:
        values = as_numbers(data, dtype)
        if values.dtype == np.float16:
            sum_sq, absmax = _float16_sum_sq_absmax(values)
        else:
            sum_sq, absmax = _sum_sq_absmax(values)
    nonfinite = 0
    if not math.isfinite(sum_sq):  # rare: NaN/inf elements, or a float32 sum that overflowed
        values = as_numbers(data, dtype)
        if values.dtype == np.float16:
            values = values.astype(np.float32)
        finite = np.isfinite(values)
        nonfinite = int(values.size - np.count_nonzero(finite))
        sum_sq, absmax = _sum_sq_absmax(values[finite], wide=True)
    if same_as_parent:  # identical bytes: unchanged, as diff says, even where they hold NaN
        return ChunkStats(sum_sq, absmax, nonfinite, 0.0, sum_sq)
    return ChunkStats(sum_sq, absmax, nonfinite, None, None)


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def stats_json(stats: TensorStats) -> dict[str, float | int | None]:
    """The manifest's ``stats`` object; a float64 sum that overflowed is written as null (JSON has no inf)."""
    return {
        "l2": _finite_or_none(stats.l2),
        "absmax": _finite_or_none(stats.absmax),
        "nonfinite": stats.nonfinite,
        "change": _finite_or_none(stats.change),
    }


def difference_sums(old: bytes | memoryview, new: bytes | memoryview, dtype: str) -> tuple[float, float]:
    """(‖new − old‖², ‖old‖²) of two equal-length, element-aligned blocks of a tensor of
    ``dtype``, in float64: the partial sums of the relative change (format.md 5.1), added up
    block by block. Diff computes them chunk by chunk, compaction for the chunks it decodes
    anyway (the change record, format.md 5.2): the same function, so the same figures."""
    import numpy as np

    # Each side widened to float64 once, the difference taken in place, and no temporary for the
    # squares: per 1 MiB chunk 0.25 ms (fp32) and 0.64 ms (bf16), against 0.32 and 0.80 casting
    # inside the ufunc's and einsum's buffers (the same sums, bit for bit) and 4.8 ms with
    # np.sum of squares. einsum, not np.dot, which may hand the sum to a threaded BLAS.
    a = as_numbers(old, dtype).astype(np.float64)
    d = as_numbers(new, dtype).astype(np.float64)
    # A tensor holding inf or NaN has no finite change: the sums come out NaN or inf, which the
    # figures report as such, without numpy's warning on stderr (inf - inf, squares past fp64).
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(d, a, out=d)
        return float(np.einsum("i,i->", d, d)), float(np.einsum("i,i->", a, a))

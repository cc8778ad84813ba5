"""Can a context-modelled entropy coder store the at-rest epochs 10% below the peers' chains?

On the checkpoints scripts/bench_at_rest.py stores (scripts/bench_data.py: all-MiniLM-L6-v2 +
AdamW, four epochs, ``--steps`` steps apart), the epochs are coded the way ckstore keeps them at
rest: the newest whole, each older epoch against the next one, per 1 MiB chunk of every tensor of
2-byte or wider elements and at least 16 KiB (the rest is a fraction of a percent), a seeded
``--sample`` of the chunks (each tensor kind and role scaled to all its bytes). Per tensor kind
(weight, ``exp_avg``, ``exp_avg_sq``) and role (newest, older), as fractions of raw:

- ``ckstore``: ckstore's encoder at level 1 without the context-sorted delta (what compaction
  writes, so what stays at rest); ``ckstore+5``: with it (what repack writes);
- ``order-0`` (newest) and ``order-1`` (older: H(byte | the same byte of the newer epoch) per
  plane, tables free: the limit docs/benchmarks.md prints);
- *adaptive* context models, per chunk: each context's counts start empty and grow with every
  symbol (a Dirichlet prior, the best of ``PRIORS``, said in 2 bits). Their code length follows
  from the final counts alone (the mixture's probability of a sequence does not depend on its
  order), so it is exact, with the cost of learning the tables in it; an adaptive arithmetic
  coder would reach it within bytes:

  - ``ctx``: older, each byte plane of the residual (the smaller of XOR and zigzag difference)
    in encoding 5's context (the base's exponent x the residual byte above, capped at 3); newest,
    the top plane order-0, the plane below in the context of the exponent, lower planes in the
    context of whether the byte above is zero;
  - ``ctx-rich``: older, the byte above in 8 classes and the byte two above as a flag;
  - ``ulp``: the zigzag difference (ulps) as its bit length, in the context of the base's
    exponent and, for a weight, of the newer epoch's Adam step |m / sqrt(v)|, for ``exp_avg_sq``
    of m^2 / v (how much of the newer v the last steps made); the two bits below the leading
    one in the context of the length, the rest raw;
  - ``moment``: an older ``exp_avg`` whole: sign and exponent in the context of the newer
    epoch's sign and exponent and of the same epoch's ``exp_avg_sq`` exponent, the top 7
    mantissa bits in the context of the exponent, the other bits raw;

- ``ctx static`` and ``moment static``: the same models coded for real with constriction's range
  coder, one static categorical table per context and chunk, the tables stored
  (``static_coded``), decoded and compared; their decode rate (M symbols per CPU second, all
  sampled chunks) is printed with the load;
- ``best static``: per chunk the smallest of ``ckstore`` and the static coders (a byte says
  which); ``best shared``: per tensor the smallest of ``ckstore`` and the models with static
  tables shared by all the tensor's chunks (``shared_table_bytes``: what a table object named by
  every chunk would store); ``best ideal``: per chunk the smallest of ``ckstore`` and the
  adaptive models.

Then bits per byte per plane (ckstore's stored planes against ``ctx``) and the totals.
``--two-back`` instead codes epochs 1 and 2 as plain deltas of a prediction from the two newer
epochs (``a * next + b * after``, least squares per tensor), beside the delta of the next epoch.

    python scripts/bench_context_coder.py [--work DIR] [--steps 60] [--runs ...] [--sample 0.25]
        [--two-back]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import zstandard
from safetensors import safe_open
from scipy.special import gammaln

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_data import RUNS, ensure_checkpoints  # noqa: E402

from ckstore.codecs.deltas import DELTA  # noqa: E402
from ckstore.codecs.objects import HEADER_SIZE, Encoding, encode_chunk, parse_header  # noqa: E402
from ckstore.codecs.planes import PLANE, grouped_parts  # noqa: E402

CHUNK = 1 << 20
FILES = ("model.safetensors", "optimizer.safetensors")
PRIORS = (0.5, 1 / 8, 1 / 32, 1 / 128)  # KT-style pseudo-counts; the coder signals its choice
BASE_ID = "00" * 32
LN2 = np.log(2.0)
RARE = 256  # symbols below which a context shares the fallback table

Tensors = dict[str, np.ndarray]


def load_epoch(folder: Path) -> Tensors:
    """Every tensor of the epoch as unsigned integers of its element width (bf16 as uint16)."""
    out: Tensors = {}
    for name in FILES:
        with safe_open(str(folder / name), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if t.element_size() < 2 or t.numel() * t.element_size() < 16384 or t.dtype.is_complex:
                    continue
                view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
                out[f"{name}:{key}"] = t.contiguous().view(view).numpy().view(f"<u{t.element_size()}").ravel()
    return out


def kind_of(name: str) -> str:
    for k in ("exp_avg_sq", "exp_avg"):
        if name.endswith("." + k):
            return k
    return "weight"


# ---- code lengths of adaptive context models -----------------------------------------------------


def adaptive_bits(symbols: np.ndarray, contexts: np.ndarray, alphabet: int) -> float:
    """Bits an adaptive per-context model (Dirichlet prior, best of ``PRIORS``, 2 bits to say
    which) codes ``symbols`` in, each in its context: -log2 of the sequence's mixture
    probability, a function of the final counts alone."""
    if symbols.size == 0:
        return 0.0
    _, ctx = np.unique(contexts, return_inverse=True)
    counts = np.bincount(ctx.astype(np.int64) * alphabet + symbols, minlength=(ctx.max() + 1) * alphabet)
    counts = counts.reshape(-1, alphabet)
    totals = counts.sum(axis=1)
    nz = counts[counts > 0]
    best = np.inf
    for a in PRIORS:
        nats = (gammaln(totals + alphabet * a) - gammaln(alphabet * a)).sum() - (gammaln(nz + a) - gammaln(a)).sum()
        best = min(best, nats / LN2)
    return best + 2


def static_coded(symbols: np.ndarray, contexts: np.ndarray, alphabet: int) -> tuple[float, float]:
    """(bytes, decode CPU seconds) of ``symbols`` coded for real with constriction's range coder, one
    static categorical table per context, the tables stored: contexts with fewer than
    ``RARE`` symbols share one table (their own would cost more than they save); each table's
    counts quantized to half-powers of two in a nibble (0: symbol absent), all of a plane's tables
    zstd-compressed together; the symbols grouped by context (the counting sort of encoding 5)."""
    import constriction

    if symbols.size == 0:
        return 0.0, 0.0
    order = np.argsort(contexts, kind="stable")
    ctx, syms = contexts[order], symbols[order].astype(np.int32)
    keys, starts, sizes = np.unique(ctx, return_index=True, return_counts=True)
    rare = sizes < RARE
    groups: list[tuple[np.ndarray, list[tuple[int, int]]]] = []
    spans = [(int(a), int(b)) for a, b in zip(starts[~rare], sizes[~rare])]
    for a, b in spans:
        groups.append((syms[a : a + b], [(a, b)]))
    if rare.any():
        rest = [(int(a), int(b)) for a, b in zip(starts[rare], sizes[rare])]
        groups.append((np.concatenate([syms[a : a + b] for a, b in rest]), rest))
    tables, models = bytearray(), []
    for group, _ in groups:
        counts = np.bincount(group, minlength=alphabet)
        q = np.zeros(alphabet, np.uint8)
        nz = counts > 0
        q[nz] = np.clip(np.round(2 * np.log2(counts[nz])) + 1, 1, 15)
        tables += np.packbits(np.unpackbits(q[:, None], axis=1)[:, 4:].ravel()).tobytes()
        probs = np.where(q > 0, 2.0 ** ((q.astype(np.float64) - 1) / 2), 0.0).astype(np.float32)
        models.append(constriction.stream.model.Categorical(probs, perfect=False))
    encoder = constriction.stream.queue.RangeEncoder()
    for (group, _), model in zip(groups, models):
        encoder.encode(group, model)
    compressed = encoder.get_compressed()
    started = time.process_time()
    decoder = constriction.stream.queue.RangeDecoder(compressed)
    out = [decoder.decode(model, group.size) for (group, _), model in zip(groups, models)]
    elapsed = time.process_time() - started
    assert all((o == g).all() for o, (g, _) in zip(out, groups))
    table_bytes = len(zstandard.ZstdCompressor(level=19).compress(bytes(tables)))
    return 4.0 * compressed.size + table_bytes + 4 * len(groups), elapsed


def shared_table_bytes(streams: list[Streams]) -> float:
    """Bytes of a tensor's chunks (``streams``: each chunk's streams, the same layout) coded with
    static tables shared by the whole tensor: each stream's empirical conditional entropy over
    all the chunks, plus its tables (as ``static_coded`` stores them) once."""
    total = 0.0
    for i in range(len(streams[0])):
        alphabet = streams[0][i][2]
        keys = np.concatenate([c[i][1].astype(np.int64) * alphabet + c[i][0] for c in streams])
        joint, counts = np.unique(keys, return_counts=True)
        ctx = joint // alphabet
        _, first, per_ctx = np.unique(ctx, return_index=True, return_counts=True)
        totals = np.add.reduceat(counts, first)
        rows = np.repeat(totals, per_ctx)
        total += float(-(counts * np.log2(counts / rows)).sum()) / 8
        used = int((totals >= RARE).sum()) + 1
        total += used * alphabet / 2 * 0.3  # nibble tables, zstd takes them to ~0.3 (measured in static_coded)
    return total


def order1_bits(x: np.ndarray, given: np.ndarray) -> float:
    """n * H(x | given), the empirical conditional entropy, no table cost (the printed limit)."""
    joint = np.bincount(given.astype(np.int64) * 256 + x, minlength=65536).astype(np.float64)
    marg = joint.reshape(256, 256).sum(axis=1)
    nz = joint > 0
    rows = np.repeat(marg, 256)[nz]
    return float(-(joint[nz] * np.log2(joint[nz] / rows)).sum())


def planes(words: np.ndarray, width: int) -> list[np.ndarray]:
    b = words.view(np.uint8).reshape(-1, width)
    return [np.ascontiguousarray(b[:, i]) for i in range(width)]


def exponent_key(base: np.ndarray, width: int) -> np.ndarray:
    """Encoding 5's exponent context: the 8 bits below the sign bit."""
    return ((base >> (8 * width - 9)) & 0xFF).astype(np.int64)


def zigzag(new: np.ndarray, base: np.ndarray, width: int) -> np.ndarray:
    signed = {2: np.int16, 4: np.int32, 8: np.int64}[width]
    d = (new - base).view(signed)
    return ((d << 1) ^ (d >> (8 * width - 1))).view(new.dtype)


Streams = list[tuple[np.ndarray, np.ndarray, int]]  # (symbols, contexts, alphabet) coded in turn


def plane_streams(res: np.ndarray, base: np.ndarray, width: int, rich: bool) -> Streams:
    """The residual's byte planes, each in encoding 5's context (``rich``: the byte above in 8
    classes and the byte two above as a flag)."""
    e = exponent_key(base, width)
    p = planes(res, width)
    out = []
    for i in range(width):
        if i == width - 1:
            ctx = e
        elif not rich:
            ctx = e * 4 + np.minimum(p[i + 1], 3)
        else:
            h = p[i + 1].astype(np.int64)
            cls = np.searchsorted(np.array([1, 2, 3, 4, 8, 16, 64]), h, side="right")
            two = (p[i + 2] > 0) if i + 2 < width else np.zeros_like(h, bool)
            ctx = (e * 8 + cls) * 2 + two
        out.append((p[i].astype(np.int64), ctx, 256))
    return out


def whole_streams(new: np.ndarray, width: int) -> Streams:
    """A chunk stored whole: the top plane order-0, the plane below in the context of the
    exponent, the lower ones in the context of whether the plane above is zero."""
    p, e, n = planes(new, width), exponent_key(new, width), new.size
    contexts = [(p[i + 1] > 0).astype(np.int64) for i in range(width - 2)] + [e, np.zeros(n, np.int64)]
    return [(p[i].astype(np.int64), contexts[i], 256) for i in range(width)]


def adaptive(streams: Streams) -> float:
    return sum(adaptive_bits(*s) for s in streams) / 8


def static(streams: Streams, timing: dict[str, float], name: str) -> float:
    total = 0.0
    for s in streams:
        size, seconds = static_coded(*s)
        total += size
        timing[name] += seconds
    return total


def bucket(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """floor(log2 x) clipped to [lo, hi], 0 and non-finite values in a class of their own."""
    with np.errstate(all="ignore"):
        b = np.floor(np.log2(np.abs(x)))
    b = np.where(np.isfinite(b), np.clip(b, lo, hi), lo - 1)
    return (b - (lo - 1)).astype(np.int64)


def ulp_bits(z: np.ndarray, ctx: np.ndarray) -> float:
    """The zigzag ulp difference as bit length (in ``ctx``), the next two bits (in the length's
    context), the rest raw."""
    z = z.astype(np.uint64)
    length = np.zeros(z.shape, np.int64)
    nz = z > 0
    length[nz] = np.floor(np.log2(z[nz].astype(np.float64))).astype(np.int64) + 1
    # float64's log2 of a 64-bit integer can round up at a power of two's edge: fix exactly
    over = nz & ((np.uint64(1) << (length - 1).clip(0).astype(np.uint64)) > z)
    length[over] -= 1
    bits = adaptive_bits(length, ctx, 65)
    top = length >= 2
    shift = (length[top] - 3).clip(0).astype(np.uint64)
    follow = ((z[top] >> shift) & np.uint64(3)).astype(np.int64)
    follow[length[top] == 2] &= 1
    bits += adaptive_bits(follow, length[top], 4)
    bits += float((length[top] - 3).clip(0).sum())
    return bits


def as_float(words: np.ndarray, width: int) -> np.ndarray:
    if width == 4:
        return words.view(np.float32).astype(np.float64)
    if width == 2:
        return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return words.view(np.float64)


def moment_streams(m_old: np.ndarray, m_new: np.ndarray, v_old: np.ndarray, width: int) -> Streams:
    """``exp_avg`` whole: sign + exponent in the context of the newer epoch's sign and exponent and
    of v's exponent; the mantissa's top 7 bits in the context of the exponent; the rest raw
    (a stream of one symbol per bit pair would cost the same: its bits are uniform)."""
    top = (m_old >> (8 * width - 9)).astype(np.int64)  # sign and 8 exponent bits
    ctx = (m_new >> (8 * width - 9)).astype(np.int64) * 256 + exponent_key(v_old, width)
    mant = 8 * width - 9
    mtop = ((m_old >> (mant - 7)) & 0x7F).astype(np.int64)
    return [(top, ctx, 512), (mtop, top & 0xFF, 128)]


def raw_mantissa_bytes(width: int, n: int) -> float:
    return (8 * width - 16) * n / 8


# ---- per chunk ------------------------------------------------------------------------------------


def ckstore_object(raw: np.ndarray, base: np.ndarray | None, width: int, repack: bool) -> bytes:
    """ckstore's encoder at level 1; ``repack``: with the context-sorted delta (repack's)."""
    allowed = frozenset(Encoding) if repack else frozenset(Encoding) - {Encoding.CONTEXT}
    data = raw.tobytes()
    if base is None:
        return encode_chunk(data, 1, width, allowed=allowed)
    return encode_chunk(data, 1, width, BASE_ID, base.tobytes(), allowed=allowed)


def plane_sizes(data: bytes, width: int) -> list[float]:
    """Stored bytes per plane of an object with a plane set (raw and zstd objects: split evenly)."""
    encoding = parse_header(data).encoding
    if encoding not in (Encoding.GROUPED, Encoding.DELTA, Encoding.CONTEXT):
        return [(len(data) - HEADER_SIZE) / width] * width
    at = HEADER_SIZE + (DELTA.size if encoding != Encoding.GROUPED else 0) + 1
    return [float(PLANE.unpack_from(data, at + i * PLANE.size)[1]) for i in range(width)]


def chunk_costs(
    kind: str,
    width: int,
    new: np.ndarray,
    base: np.ndarray | None,
    aux: dict[str, np.ndarray],
    timing: dict[str, float],
    kept: dict[str, Streams],
) -> dict[str, float]:
    """Bytes of each coder for one chunk (``base``: the newer epoch's chunk; None when whole);
    ``kept`` gets the context models' streams (for tables shared by a tensor's chunks)."""
    current = ckstore_object(new, base, width, repack=False)
    out = {"ckstore": float(len(current))}
    out["ckstore+5"] = float(len(ckstore_object(new, base, width, repack=True)))
    for i, size in enumerate(plane_sizes(current, width)):
        out[f"ckstore p{i}"] = size
    n = new.size
    raw_bytes = float(new.nbytes)
    if base is None:
        out["order-0"] = (
            sum(adaptive_bits(p.astype(np.int64), np.zeros(n, np.int64), 256) for p in planes(new, width)) / 8
        )
        streams = whole_streams(new, width)
        out["ctx"] = adaptive(streams)
        out.update({f"ctx p{i}": adaptive_bits(*st) / 8 for i, st in enumerate(streams)})
        out["ctx static"] = static(streams, timing, "ctx static")
        kept["ctx"] = streams
        return {k: min(v, raw_bytes) for k, v in out.items()}
    xor, zz = new ^ base, zigzag(new, base, width)
    out["order-1"] = sum(order1_bits(a, b) for a, b in zip(planes(new, width), planes(base, width))) / 8
    options = [plane_streams(r, base, width, rich=False) for r in (xor, zz)]
    sizes = [adaptive(o) for o in options]
    out["ctx"] = min(sizes)
    out.update({f"ctx p{i}": adaptive_bits(*st) / 8 for i, st in enumerate(options[int(np.argmin(sizes))])})
    out["ctx static"] = static(options[int(np.argmin(sizes))], timing, "ctx static")
    kept["ctx"] = options[int(np.argmin(sizes))]
    out["ctx-rich"] = min(adaptive(plane_streams(r, base, width, rich=True)) for r in (xor, zz))
    e = exponent_key(base, width)
    extra = np.zeros(n, np.int64)
    if kind == "weight" and "step" in aux:
        extra = bucket(aux["step"], -12, 2)
    elif kind == "exp_avg_sq" and "share" in aux:
        extra = bucket(aux["share"], -20, 0)
    out["ulp"] = ulp_bits(zz, e * 32 + extra) / 8
    if kind == "exp_avg" and "v_old" in aux:
        streams = moment_streams(new, base, aux["v_old"], width)
        out["moment"] = adaptive(streams) + raw_mantissa_bytes(width, n)
        out["moment static"] = static(streams, timing, "moment static") + raw_mantissa_bytes(width, n)
        kept["moment"] = streams
    return {k: min(v, raw_bytes) for k, v in out.items()}


def auxiliaries(name: str, newer: Tensors, same: Tensors, width: int, lo: int, hi: int) -> dict[str, np.ndarray]:
    """Side information a decoder could have: the newer epoch's optimizer state, the same
    epoch's other moment."""
    out: dict[str, np.ndarray] = {}
    if name.startswith("model.safetensors:"):
        key = name.split(":", 1)[1]
        m, v = newer.get(f"optimizer.safetensors:{key}.exp_avg"), newer.get(f"optimizer.safetensors:{key}.exp_avg_sq")
        if m is not None and v is not None and m.size == newer[name].size:
            mf, vf = as_float(m[lo:hi], width), as_float(v[lo:hi], width)
            with np.errstate(all="ignore"):
                out["step"] = mf / (np.sqrt(vf) + 1e-8)
    elif name.endswith(".exp_avg_sq"):
        m = newer.get(name[: -len("_sq")])
        if m is not None:
            mf, vf = as_float(m[lo:hi], width), as_float(newer[name][lo:hi], width)
            with np.errstate(all="ignore"):
                out["share"] = mf * mf / vf
    elif name.endswith(".exp_avg"):
        v = same.get(name + "_sq")
        if v is not None:
            out["v_old"] = v[lo:hi]
    return out


STATIC = ("ckstore", "ctx static", "moment static")  # coders built for real
IDEAL = ("ckstore", "ctx", "ctx-rich", "ulp", "moment")  # adaptive models' code lengths


def measure(
    dirs: list[Path], sample: float, seed: int
) -> tuple[dict[tuple[str, str], dict[str, float]], int, dict[str, float]]:
    """Summed bytes per (kind, role) and coder, scaled up from the sampled chunks; raw bytes of
    the four epochs' files; decode CPU seconds of the static coders (of the sampled chunks)."""
    epochs = [load_epoch(d) for d in dirs]
    raw_total = sum(os.path.getsize(d / f) for d in dirs for f in FILES)
    rng = random.Random(seed)
    sums: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    timing: dict[str, float] = defaultdict(float)
    for k in range(len(epochs) - 1, -1, -1):
        cur, newer = epochs[k], epochs[k + 1] if k + 1 < len(epochs) else None
        role = "newest" if newer is None else "older"
        for name, words in cur.items():
            width = words.dtype.itemsize
            per = CHUNK // width
            sums[(kind_of(name), role)]["all raw"] += words.nbytes
            tensor: dict[str, list[Streams]] = defaultdict(list)
            tensor_bytes: dict[str, float] = defaultdict(float)
            for lo in range(0, words.size, per):
                if rng.random() >= sample:
                    continue
                hi = min(lo + per, words.size)
                base = newer[name][lo:hi] if newer is not None and name in newer else None
                aux = auxiliaries(name, newer, cur, width, lo, hi) if newer is not None else {}
                kept: dict[str, Streams] = {}
                costs = chunk_costs(kind_of(name), width, words[lo:hi], base, aux, timing, kept)
                for coder, streams in kept.items():
                    tensor[coder].append(streams)
                tensor_bytes["ckstore"] += costs["ckstore"]
                tensor_bytes["mantissa"] += raw_mantissa_bytes(width, hi - lo)
                costs["best static"] = min(costs[c] for c in STATIC if c in costs) + 1  # choice in a byte
                costs["best ideal"] = min(costs[c] for c in IDEAL if c in costs) + 1
                acc = sums[(kind_of(name), role)]
                acc["raw"] += (hi - lo) * width
                for c, v in costs.items():
                    acc[c] += v
                    if c in ("ctx static", "moment static"):
                        acc["static symbols"] += (hi - lo) * (2 if c == "moment static" else width)
            if tensor_bytes:
                shared = [tensor_bytes["ckstore"]]
                if "ctx" in tensor:
                    shared.append(shared_table_bytes(tensor["ctx"]))
                if "moment" in tensor and len(tensor["moment"]) == len(tensor["ctx"]):
                    shared.append(shared_table_bytes(tensor["moment"]) + tensor_bytes["mantissa"])
                sums[(kind_of(name), role)]["best shared"] += min(shared)
    for acc in sums.values():  # stratified: each kind and role scaled to all its bytes
        scale = acc.pop("all raw") / max(acc["raw"], 1)
        for c in list(acc):
            if c != "static symbols":
                acc[c] *= scale
    return sums, raw_total, timing


CODERS = (
    "ckstore", "ckstore+5", "order-0", "order-1", "ctx", "ctx static", "ctx-rich", "ulp", "moment",
    "moment static", "best static", "best shared", "best ideal",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=str(ROOT / "bench-work"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--sample", type=float, default=0.25, help="share of chunks measured (seeded)")
    parser.add_argument("--two-back", action="store_true", help="only the two-epochs-back prediction")
    args = parser.parse_args()
    data = ensure_checkpoints(Path(args.work) / "checkpoints", steps=args.steps, runs=tuple(args.runs))
    if args.two_back:
        print("| run | kind | raw MB (epochs 1-2) | whole | delta of the next epoch | + delta of a*next + b*after |")
        print("|---|---|---|---|---|---|")
        for run in args.runs:
            for kind, (raw, whole, one, two) in sorted(two_back(data[run]).items()):
                print(
                    f"| {run} | {kind} | {raw / 1e6:.0f} | {whole / raw:.4f} | {one / raw:.4f} | {two / raw:.4f} |",
                    flush=True,
                )
        return
    print(f"load {os.getloadavg()[0]:.1f}")
    print("| run | kind | role | raw MB | " + " | ".join(CODERS) + " |")
    print("|---|---|---|---|" + "---|" * len(CODERS))
    totals, by_plane = {}, []
    for run in args.runs:
        sums, raw_total, timing = measure(data[run], args.sample, seed=0)
        by_plane.append((run, sums))
        for (kind, role), acc in sorted(sums.items()):
            cells = [f"{acc[c] / acc['raw']:.3f}" if c in acc else "" for c in CODERS]
            print(f"| {run} | {kind} | {role} | {acc['raw'] / 1e6:.0f} | " + " | ".join(cells) + " |", flush=True)
        symbols = sum(a.get("static symbols", 0.0) for a in sums.values())
        rate = symbols / max(sum(timing.values()), 1e-9) / 1e6
        totals[run] = {c: sum(a.get(c, a["ckstore"]) for a in sums.values()) / raw_total for c in CODERS}
        totals[run]["rate"] = rate
    print_planes(by_plane)
    print()
    print(
        "| run | ckstore at rest / raw | + encoding 5 | best static / raw | ratio | best shared / raw | ratio "
        "| best ideal / raw | ratio | static decode, M symbols/s | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run, t in totals.items():
        print(
            f"| {run} | {t['ckstore']:.3f} | {t['ckstore+5']:.3f} | {t['best static']:.3f} | {t['best static'] / t['ckstore']:.3f} | "
            f"{t['best shared']:.3f} | {t['best shared'] / t['ckstore']:.3f} | "
            f"{t['best ideal']:.3f} | {t['best ideal'] / t['ckstore']:.3f} | {t['rate']:.0f} | {os.getloadavg()[0]:.1f} |"
        )


def from_float(values: np.ndarray, width: int) -> np.ndarray:
    """float64 values to the element type's bits (round to nearest even)."""
    f32 = values.astype(np.float32)
    if width == 4:
        return f32.view(np.uint32)
    return torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def grouped_delta_bytes(new: np.ndarray, base: np.ndarray, width: int) -> int:
    """ckstore's plain delta of ``new`` against ``base`` (the smaller of XOR and zigzag
    difference, byte planes at level 1), summed over 1 MiB chunks."""
    total, per = 0, CHUNK // width
    for lo in range(0, new.size, per):
        a, b = new[lo : lo + per], base[lo : lo + per]
        total += min(grouped_parts(r.tobytes(), width, 1)[0] for r in (a ^ b, zigzag(a, b, width)))
    return total


def two_back(dirs: list[Path]) -> dict[str, list[float]]:
    """Per kind, for epochs 1 and 2 (the ones with two newer epochs): bytes stored whole, as
    ckstore's plain delta of the next epoch, and as a plain delta of a prediction from the next
    two, ``a * next + b * after`` (least squares per tensor; a decoder would read a and b from
    the object), each the smallest so far per tensor: [raw, whole, 1 back, 2 back]."""
    epochs = [load_epoch(d) for d in dirs]
    out: dict[str, list[float]] = defaultdict(lambda: [0.0] * 4)
    for k in range(len(epochs) - 2):
        for name, old in epochs[k].items():
            width = old.dtype.itemsize
            new, after = epochs[k + 1][name], epochs[k + 2][name]
            whole = sum(
                grouped_parts(old[lo : lo + CHUNK // width].tobytes(), width, 1)[0]
                for lo in range(0, old.size, CHUNK // width)
            )
            one = min(whole, grouped_delta_bytes(old, new, width))
            a, b, o = as_float(new, width), as_float(after, width), as_float(old, width)
            fit = np.isfinite(a) & np.isfinite(b) & np.isfinite(o)
            coef = np.linalg.lstsq(np.stack([a[fit], b[fit]], 1)[::7], o[fit][::7], rcond=None)[0]
            with np.errstate(all="ignore"):
                predicted = from_float(coef[0] * a + coef[1] * b, width)
            two = min(one, grouped_delta_bytes(old, predicted, width))
            acc = out[kind_of(name)]
            for i, v in enumerate((old.nbytes, whole, one, two)):
                acc[i] += v
    return out


def print_planes(by_plane: list[tuple[str, dict[tuple[str, str], dict[str, float]]]]) -> None:
    """Bits per byte of each plane: ckstore's stored plane against the adaptive ``ctx`` model."""
    print()
    print("| run | kind | role | plane: ckstore bits/byte -> ctx model bits/byte (share of the kind's ckstore bytes) |")
    print("|---|---|---|---|")
    for run, sums in by_plane:
        for (kind, role), acc in sorted(sums.items()):
            width = sum(1 for c in acc if c.startswith("ckstore p"))
            per = acc["raw"] / width
            cells = [
                f"p{i}: {8 * acc[f'ckstore p{i}'] / per:.2f} -> {8 * acc[f'ctx p{i}'] / per:.2f} "
                f"({acc[f'ckstore p{i}'] / acc['ckstore']:.0%})"
                for i in range(width - 1, -1, -1)
            ]
            print(f"| {run} | {kind} | {role} | " + "; ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""Loopback measurements for the remote transport (not a test; run by hand):

    PYTHONPATH=. python -m tests.remote.measure_transfer [--objects 256] [--size-mib 1]

Starts SeaweedFS as the tests do, then compares N objects of 1 MiB stored as N S3 objects with
the same objects in packs of the default 32 MiB target, read back by ranged GETs: wall time (directly against the server)
and request counts (the same operations again through the counting proxy). The objects are
random, so no compression plays a part: this measures the transport and the pack layout only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckstore.codecs.objects import Kind, encode
from ckstore.format import pack, pack_build
from ckstore.format.ids import chunk_id
from ckstore.transport.s3 import S3Transport
from ckstore.transport.testserver import S3Server, seaweedfs

from .faultproxy import FaultProxy


def scenarios(
    t: S3Transport, objects: list[tuple[str, bytes]], packs: list[pack_build.BuiltPack]
) -> dict[str, Callable[[], object]]:
    pool = ThreadPoolExecutor(8)
    entries = [(f"packs/{p.name}.pack", e) for p in packs for e in p.index.in_pack_order()]

    def ranges(step: int) -> None:
        for p in packs:
            order = p.index.in_pack_order()[::step]
            t.get_ranges(f"packs/{p.name}.pack", [(e.offset, e.length) for e in order])

    return {
        "put N objects, 1 thread": lambda: [t.put(f"loose/{oid}", data) for oid, data in objects],
        "get N objects, 1 thread": lambda: [t.get(f"loose/{oid}") for oid, _ in objects],
        "put N objects, 8 threads": lambda: list(pool.map(lambda o: t.put(f"loose8/{o[0]}", o[1]), objects)),
        "get N objects, 8 threads": lambda: list(pool.map(lambda o: t.get(f"loose8/{o[0]}"), objects)),
        "put packs (+ indexes)": lambda: [
            (t.put(f"packs/{p.name}.pack", p.data), t.put(f"packs/{p.name}.idx", p.index_data)) for p in packs
        ],
        "get packs whole": lambda: [t.get(f"packs/{p.name}.pack") for p in packs],
        "get indexes": lambda: [pack.parse_index(t.get(f"packs/{p.name}.idx"), p.name) for p in packs],
        "N ranged gets, 1 thread": lambda: [t.get_range(k, e.offset, e.length) for k, e in entries],
        "N ranged gets, 8 threads": lambda: list(
            pool.map(lambda ke: t.get_range(ke[0], ke[1].offset, ke[1].length), entries)
        ),
        "get_ranges all, per pack": lambda: ranges(1),
        "get_ranges every other": lambda: ranges(2),
    }


def run(server: S3Server, n: int, size: int, repeat: int) -> None:
    print(f"SeaweedFS answered S3 {server.startup_seconds:.2f} s after start")
    objects = []
    for _ in range(n):
        raw = os.urandom(size)
        objects.append((chunk_id(raw), encode(raw, Kind.CHUNK, 1)))
    packs = list(pack_build.pack_objects(objects))
    total = sum(len(d) for _, d in objects)
    index_bytes = sum(len(p.index_data) for p in packs)
    print(
        f"{n} objects x {size / 2**20:.3f} MiB = {total / 2**20:.1f} MiB in {len(packs)} packs "
        f"of <= {max(len(p.data) for p in packs) / 2**20:.2f} MiB; indexes {index_bytes} bytes "
        f"({index_bytes / n:.1f} per object)"
    )
    timings: dict[str, float] = {}
    for _ in range(repeat):  # best of: the machine is shared by the server and the client
        direct = S3Transport(
            server.bucket, f"bench/{uuid.uuid4().hex}", server.options(request_timeout=300), env=server.env
        )
        for name, fn in scenarios(direct, objects, packs).items():
            started = time.perf_counter()
            fn()
            timings[name] = min(timings.get(name, float("inf")), time.perf_counter() - started)
    with FaultProxy(server.endpoint) as proxy:
        counted = S3Transport(
            server.bucket,
            f"bench/{uuid.uuid4().hex}",
            server.options(endpoint_url=proxy.url, request_timeout=300),
            env=server.env,
        )
        counts = {}
        for name, fn in scenarios(counted, objects, packs).items():
            proxy.reset()
            fn()
            counts[name] = proxy.count()
    print(f"{'operation':28} {'seconds':>8} {'MiB/s':>8} {'requests':>9}")
    for name, seconds in timings.items():
        moved = total / 2 if "every other" in name else index_bytes if name == "get indexes" else total
        print(f"{name:28} {seconds:8.3f} {moved / 2**20 / seconds:8.1f} {counts[name]:9d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=256)
    parser.add_argument("--size-mib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    for name in [k for k in os.environ if k.startswith("AWS_") and k != "AWS_CA_BUNDLE"]:
        del os.environ[name]
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    with tempfile.TemporaryDirectory() as folder, seaweedfs(Path(folder)) as server:
        run(server, args.objects, int(args.size_mib * 2**20), args.repeat)


if __name__ == "__main__":
    main()

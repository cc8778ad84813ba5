"""Peak memory of a DCP save to and load from S3 (the bundled SeaweedFS) for a large shard.

    python scripts/bench_dcp_remote_memory.py [--size-gib 1] [--work DIR]

A child process builds a state of ``--size-gib`` of float32 tensors (one rank's shard, the world
being that one process), saves it with ``ckstore.dcp.Writer("s3://…")``, then loads it back into
zeroed tensors of the same shapes and checks every byte. Its peak RSS (``ru_maxrss``) is read
after the state exists, after the save and after the load: the figures are what saving and
loading hold on top of the state itself (and, for the load, on top of the state and its
zeroed target). Target: under 500 MiB for a 1 GiB shard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ckstore.transport.testserver import seaweedfs

MIB = 1 << 20
CHILD = """
import json, resource, sys
import torch
import torch.distributed.checkpoint as dcp
import ckstore.dcp

url, size, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def shard():
    torch.manual_seed(0)
    rows = size // 4 // 4 // 1024
    return {f"layer{i}.weight": torch.empty(rows, 1024).normal_(0, 0.02) for i in range(4)}  # no temporaries
if mode == "save":
    state = shard()
    state["step"] = 1
    before = rss()
    dcp.save(state, storage_writer=ckstore.dcp.Writer(url))
    json.dump({"before": before, "peak": rss()}, sys.stdout)
else:  # a fresh process: the target is zeros, the expected values are made only after the load
    rows = size // 4 // 4 // 1024
    target = {f"layer{i}.weight": torch.zeros(rows, 1024) for i in range(4)}
    target["step"] = 0
    before = rss()
    dcp.load(target, storage_reader=ckstore.dcp.Reader(url))
    peak = rss()
    want = shard()
    same = all(torch.equal(want[k], target[k]) for k in want) and target["step"] == 1
    json.dump({"before": before, "peak": peak, "same": same}, sys.stdout)
"""


def child(url: str, size: int, mode: str, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, url, str(size), mode], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    size = int(args.size_gib * (1 << 30))
    with tempfile.TemporaryDirectory(dir=args.work) as work, seaweedfs(Path(work)) as server:
        env = {**os.environ, **server.env, "AWS_ENDPOINT_URL": server.endpoint, "TMPDIR": work}
        url = f"s3://{server.bucket}/memory"
        saved = child(url, size, "save", env)
        loaded = child(url, size, "load", env)
    print(f"shard {size / MIB:.0f} MiB, one rank; uptime load {os.getloadavg()}")
    print(
        f"save: peak RSS {saved['peak'] / MIB:.0f} MiB, {(saved['peak'] - saved['before']) / MIB:.0f} MiB above the state"
    )
    print(
        f"load: peak RSS {loaded['peak'] / MIB:.0f} MiB, {(loaded['peak'] - loaded['before']) / MIB:.0f} MiB above the target"
    )
    print(f"bit-identical: {loaded['same']}")


if __name__ == "__main__":
    main()

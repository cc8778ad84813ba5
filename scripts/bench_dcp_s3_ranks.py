"""The ranks of scripts/bench_dcp_s3.py (launched by it with torchrun; not run by hand).

``--job save``: train the GPT-style model between saves and save with every writer, timing each
and reading the server's per-bucket traffic counter and listing after it; the full state after the
last save is written as the reference. ``--job load``: load the last save at this world size with
every writer and compare it bit for bit with the reference. ``--job rss``: two saves of a larger
state with every writer, each rank's resident set sampled.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

WRITERS = ("fsspec", "s3tc", "ckstore")
REGION = "us-east-1"
LOAD_WORLDS = (1, 2, 4)


def bucket_of(writer: str, mode: str) -> str:
    return f"bench-{writer}-{mode}"


# ---------------------------------------------------------------------------------------------
# The model and its training (run in the ranks)


def build_model(dim: int, layers: int, vocab: int, seq: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.heads = max(1, dim // 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
            a = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return GPT()


def sharded(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (seeded alike on every rank) sharded with FSDP2, and its AdamW."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = build_model(args.dim, args.layers, args.vocab, args.seq)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


class Tokens:
    """A synthetic corpus: a fixed random Markov chain over the vocabulary (few likely successors
    per token), each rank walking its own part of it."""

    def __init__(self, vocab: int, seq: int, batch: int, rank: int) -> None:
        import torch

        g = torch.Generator().manual_seed(1234)
        self.successors = torch.randint(0, vocab, (vocab, 4), generator=g)
        self.gen = torch.Generator().manual_seed(100 + rank)
        self.vocab, self.seq, self.batch = vocab, seq, batch

    def next(self) -> Any:
        import torch

        x = torch.empty(self.batch, self.seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, self.vocab, (self.batch,), generator=self.gen)
        for t in range(self.seq):
            pick = torch.randint(0, 4, (self.batch,), generator=self.gen)
            x[:, t + 1] = self.successors[x[:, t], pick]
        return x


def train(model: Any, opt: Any, data: Tokens, steps: int) -> float:
    import torch

    loss = torch.zeros(())
    for _ in range(steps):
        x = data.next()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss)


# ---------------------------------------------------------------------------------------------
# Storage writers and readers (run in the ranks)


def storage_options() -> dict[str, Any]:
    return {"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": REGION}}


def _s3tc_fs(reader_constructor: Any = None) -> Any:
    # S3StorageWriter/Reader build their client from the region alone (its native client also
    # honours AWS_ENDPOINT_URL, which the ranks have); the endpoint is given explicitly so that the
    # figures do not rest on that, with path-style addressing for a local server.
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    config = S3ClientConfig(force_path_style=True)
    client = S3Client(REGION, endpoint=os.environ["AWS_ENDPOINT_URL"], s3client_config=config)
    return S3FileSystem(REGION, s3_client=client, reader_constructor=reader_constructor)


def make_writer(name: str, bucket: str, run: int, step: int) -> Any:
    if name == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(f"s3://{bucket}/run{run}/step{step}", **storage_options())
    if name == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(
            REGION, f"s3://{bucket}/run{run}/step{step}", s3client_config=S3ClientConfig(force_path_style=True)
        )
        writer.fs = _s3tc_fs()
        return writer
    import ckstore.dcp

    return ckstore.dcp.Writer(f"s3://{bucket}/run{run}", message=f"step {step}")


def make_reader(name: str, bucket: str, run: int, step: int) -> Any:
    if name == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(f"s3://{bucket}/run{run}/step{step}", **storage_options())
    if name == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(
            REGION, f"s3://{bucket}/run{run}/step{step}", s3client_config=S3ClientConfig(force_path_style=True)
        )
        reader.fs = _s3tc_fs(reader._reader_constructor)
        return reader
    import ckstore.dcp

    return ckstore.dcp.Reader(f"s3://{bucket}/run{run}")


def settle(name: str) -> float:
    """Wait for what a writer still does after its save returned (ckstore's background work: on
    the coordinator, the detached remote compaction); the CPU seconds it took (the processes
    reaped meanwhile, this rank's only children)."""
    import resource

    if name != "ckstore":
        return 0.0
    import ckstore.dcp

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    ckstore.dcp.wait_compaction()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


# ---------------------------------------------------------------------------------------------
# Measurements (run in the ranks)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss(out: dict[str, int], interval: float = 0.005) -> Iterator[None]:
    """Sample this process's resident set while the block runs: ``out`` gets before and peak."""
    out["before"] = out["peak"] = rss()
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            out["peak"] = max(out["peak"], rss())
            done.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        out["peak"] = max(out["peak"], rss())


def s3_client() -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name=REGION)


def listed_bytes(client: Any, bucket: str) -> int:
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        total += sum(o["Size"] for o in page.get("Contents", []))
    return total


def traffic(kind: str) -> dict[str, float]:
    """Per bucket, bytes the server received (``kind="received"``) or sent since it started."""
    import urllib.request

    text = urllib.request.urlopen(os.environ["BENCH_METRICS_URL"], timeout=10).read().decode()
    prefix = f'SeaweedFS_s3_bucket_traffic_{kind}_bytes_total{{bucket="'
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line[len(prefix) :].split('"} ')
            out[name] = float(value)
    return out


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def largest(values: list[int]) -> list[int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t]


def full_state(model: Any, opt: Any) -> dict[str, Any]:
    """The whole state as flat tensors (gathered on rank 0), in the form the check compares."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat: dict[str, Any] = {}
    _flatten({"model": msd, "optim": osd}, "", flat)
    return flat


def _flatten(value: Any, key: str, out: dict[str, Any]) -> None:
    """Nested dicts and lists to ``a.b.c`` keys; numbers become 0-d tensors so they compare too."""
    import torch

    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{key}.{k}" if key else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{key}.{i}", out)
    elif isinstance(value, torch.Tensor):
        out[key] = value.detach().contiguous()
    elif isinstance(value, (bool, int, float)):
        out[key] = torch.tensor(value)


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose tensors differ in dtype, shape or any byte."""
    import torch

    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        ):
            bad.append(k)
    return bad


# ---------------------------------------------------------------------------------------------
# The ranks' three jobs


def init_rank() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank()


def save_one(
    name: str, bucket: str, args: argparse.Namespace, step: int, state: dict[str, Any], asynchronous: bool
) -> dict[str, float]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.barrier()
    writer = make_writer(name, bucket, args.trial, step)
    started = time.perf_counter()
    # "compacted_after": seconds from the save's end (dcp.save returned, or its future done) to
    # the end of what the writer still did after it; "compaction_cpu": that work's CPU seconds.
    # The collectives (``slowest``) wait until the save is done: an async save's upload still
    # uses the process group before.
    blocked = None
    if asynchronous:
        future = dcp.async_save(state, storage_writer=writer)
        blocked = time.perf_counter() - started
        future.result()
    else:
        dcp.save(state, storage_writer=writer)
    done = time.perf_counter() - started
    cpu = settle(name)
    settled = time.perf_counter() - started
    if blocked is not None:
        timing = {"blocked": slowest(blocked), "total": slowest(settled)}
    else:
        timing = {"wall": slowest(done), "settled": slowest(settled)}
    return {**timing, "compacted_after": slowest(settled - done), "compaction_cpu": slowest(cpu)}


def worker_save(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = init_rank()
    out = Path(args.out)
    model, opt = sharded(args)
    data = Tokens(args.vocab, args.seq, args.batch, rank)
    client = s3_client() if rank == 0 else None
    rows: list[dict[str, Any]] = []
    for step in range(args.saves):
        started = time.perf_counter()
        loss = train(model, opt, data, args.steps)
        row: dict[str, Any] = {"train_s": slowest(time.perf_counter() - started), "loss": loss}
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        order = args.writers[step % len(args.writers) :] + args.writers[: step % len(args.writers)]
        for mode in ("sync", "async"):
            for name in order:
                before = traffic("received") if rank == 0 else {}
                timing = save_one(name, bucket_of(name, mode), args, step, state, mode == "async")
                dist.barrier()
                if client is not None:
                    bucket = bucket_of(name, mode)
                    timing["uploaded"] = traffic("received").get(bucket, 0.0) - before.get(bucket, 0.0)
                    timing["on_bucket"] = listed_bytes(client, bucket)
                row[f"{name}.{mode}"] = timing
        rows.append(row)
        if rank == 0:
            print(f"save {step + 1}: {json.dumps(row)}", flush=True)
    reference = full_state(model, opt)
    if rank == 0:
        save_file(reference, str(out / "reference.safetensors"))
        state_bytes = sum(v.numel() * v.element_size() for v in reference.values())
        (out / "save.json").write_text(json.dumps({"rows": rows, "state_bytes": state_bytes}))
    dist.destroy_process_group()


def worker_load(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = init_rank()
    out = Path(args.out)
    reference = load_file(str(out / "reference.safetensors")) if rank == 0 else {}
    result: dict[str, Any] = {}
    for name in args.writers:
        model, opt = sharded(args)
        msd, osd = get_state_dict(model, opt)  # the optimizer state exists (zeros) to be loaded into
        state = {"model": msd, "optim": osd, "step": -1}
        bucket = bucket_of(name, "sync")
        before = traffic("sent") if rank == 0 else {}
        dist.barrier()
        started = time.perf_counter()
        dcp.load(state, storage_reader=make_reader(name, bucket, args.trial, args.saves - 1))
        seconds = slowest(time.perf_counter() - started)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = full_state(model, opt)
        if rank == 0:
            bad = same_bits(reference, loaded)
            downloaded = traffic("sent").get(bucket, 0.0) - before.get(bucket, 0.0)
            result[name] = {"load_s": seconds, "downloaded": downloaded, "step": state["step"], "differs": bad[:5]}
            print(f"load at {dist.get_world_size()} ranks, {name}: {json.dumps(result[name])}", flush=True)
    if rank == 0:
        (out / f"load{dist.get_world_size()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def worker_local(args: argparse.Namespace) -> None:
    """The same training and saves into a local ckstore repository (compaction waited for) and
    FileSystemWriter folders: what a repository on a shared disk holds, for the bytes target."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckstore.dcp

    rank = init_rank()
    out = Path(args.out)
    model, opt = sharded(args)
    data = Tokens(args.vocab, args.seq, args.batch, rank)
    rows = []
    for step in range(args.saves):
        train(model, opt, data, args.steps)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out / "fs" / f"step{step}")))
        dist.barrier()
        dcp.save(state, storage_writer=ckstore.dcp.Writer(out / "repo", message=f"step {step}"))
        ckstore.dcp.wait_compaction()
        dist.barrier()
        if rank == 0:
            rows.append({"fs": _du(out / "fs"), "ckstore": _du(out / "repo")})
            print(f"local save {step + 1}: {json.dumps(rows[-1])}", flush=True)
    if rank == 0:
        (out / "local.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker_rss(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = init_rank()
    result: dict[str, Any] = {"interpreter": largest([rss()])[0]}  # torch imported, no state yet
    model, opt = sharded(args)
    data = Tokens(args.vocab, args.seq, args.batch, rank)
    for step in range(2):
        train(model, opt, data, 1)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": step}
        shard = sum(t.to_local().numel() * t.element_size() for t in _tensors(state))
        for name in args.writers:
            dist.barrier()
            writer = make_writer(name, bucket_of(name, "rss"), args.trial, step)
            sample: dict[str, int] = {}
            with peak_rss(sample):
                dcp.save(state, storage_writer=writer)
                settle(name)
            before, peak = largest([sample["before"], sample["peak"] - sample["before"]])
            result[f"{name}.{step}"] = {"before": before, "above": peak, "shard": largest([shard])[0]}
            if rank == 0:
                print(f"rss {name} save {step + 1}: {json.dumps(result[f'{name}.{step}'])}", flush=True)
    if rank == 0:
        (Path(args.out) / "rss.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _tensors(state: Any) -> Iterator[Any]:
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, DTensor):
        yield state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", choices=["save", "load", "rss", "local"], required=True)
    for name in ("dim", "layers", "vocab", "seq", "batch", "steps", "saves", "trial"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--writers", nargs="+", choices=WRITERS, required=True)
    args = parser.parse_args()
    {"save": worker_save, "load": worker_load, "rss": worker_rss, "local": worker_local}[args.job](args)


if __name__ == "__main__":
    main()

"""A remote fed by ``ckstore push`` alone: its bytes against the local repository's, per epoch.

    python scripts/bench_remote_pace.py EPOCH_DIR... | --real WORK [--epochs 4] | --stand-in N
        [--kinds dir s3] [--write-docs docs/benchmarks.md]

Runs the user's path with the real CLI (``ckstore`` in a process of its own for each command, the
compaction after each commit detached as the CLI detaches it): ``ckstore commit`` of each epoch
folder, ``ckstore push`` right after it (so a push may run before the compaction that re-encodes
the previous epoch has finished), and at the end ``ckstore wait`` and ``ckstore push``. After every
push it prints the remote's bytes (every key: packs, indexes, refs, lists) over the local store's
stored bytes (``ckstore stats``), for a folder remote and an S3 one (the bundled SeaweedFS
server), with the machine's load. No push waits for any grace period: the default one (an hour)
is in force throughout.

``--real WORK`` uses the all-MiniLM-L6-v2 fp32 full fine-tune epochs, 60 AdamW steps apart
(scripts/bench_data.py, cached in WORK/checkpoints/s60/fp32_full, trained when absent);
``--stand-in N`` a smaller real AdamW fine-tune (an MLP) for when N MiniLM epochs take too long.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sections import write_section  # noqa: E402

from ckstore.remote.names import open_remote  # noqa: E402
from ckstore.repository.context import open_context  # noqa: E402
from ckstore.transport.testserver import seaweedfs  # noqa: E402


def ckstore(repo: Path, *args: str) -> str:
    """``ckstore --repo REPO ARGS`` as a user runs it (this checkout's code); its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", "from ckstore.cli import run; run()", "--repo", str(repo), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"ckstore {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def remote_bytes(repo: Path | str) -> int:
    return sum(info.size for info in open_remote(open_context(repo)).transport.list(""))


def local_bytes(repo: Path) -> int:
    return int(json.loads(ckstore(repo, "stats", "--json"))["stored_bytes"])


def load() -> float:
    return os.getloadavg()[0]


def run(kind: str, url: str, endpoint: str | None, epochs: list[Path], work: Path) -> list[dict[str, float | str]]:
    """The user's path over ``epochs``; a row per push: label, remote, local (after the push), the
    ratio, the ratio to the local store as the push began (compaction goes on meanwhile),
    seconds, load."""
    repo = work / f"repo-{kind}-{len(epochs)}"
    ckstore(repo, "init")
    ckstore(repo, "remote", "add", "origin", url, *(["--endpoint-url", endpoint] if endpoint else []))
    rows: list[dict[str, float | str]] = []

    def push(label: str) -> None:
        before = local_bytes(repo)
        started = time.perf_counter()
        ckstore(repo, "push")
        seconds = time.perf_counter() - started
        remote, local = remote_bytes(repo), local_bytes(repo)
        rows.append(
            dict(
                label=label,
                remote=remote,
                local=local,
                ratio=remote / local,
                seen=remote / before,
                seconds=seconds,
                load=load(),
            )
        )
        print(
            f"{kind} {label}: remote {remote / 2**20:.1f} MiB / local {local / 2**20:.1f} MiB = {remote / local:.3f}x"
            f" (/ local before the push {remote / before:.3f}x)"
            f" (push {seconds:.1f} s; load {load():.1f})",
            flush=True,
        )

    for n, folder in enumerate(epochs, 1):
        ckstore(repo, "commit", str(folder), "-m", f"epoch {n}")
        push(f"epoch {n}'s push")
    ckstore(repo, "wait")
    push("`ckstore wait` + push")
    shutil.rmtree(repo, ignore_errors=True)
    return rows


def stand_in_epochs(out: Path, epochs: int, steps: int = 60) -> list[Path]:
    """A real but small AdamW fine-tune (an fp32 MLP 1024 -> 2048 -> 1024, ``steps`` steps an
    epoch, 49 MB an epoch with both moments): epochs where training MiniLM for each is too slow."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    folders = []
    for epoch in range(1, epochs + 1):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        folder = out / f"epoch{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
            str(folder / "model.safetensors"),
        )
        moments = {}
        for i, p in enumerate(model.parameters()):
            moments[f"{i}.exp_avg"], moments[f"{i}.exp_avg_sq"] = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
        save_file({k: v.clone() for k, v in moments.items()}, str(folder / "optimizer.safetensors"))
        folders.append(folder)
    return folders


def run_remote_compaction(
    url: str, endpoint: str | None, epochs: list[Path], work: Path
) -> list[dict[str, float | str]]:
    """Commits pushed as stored (never compacted anywhere: what writers uploading straight to the
    remote leave), each followed by ``compact_remote`` from a machine holding nothing; against a
    local repository compacted after each commit the same way (its newest commit not settled)."""
    from ckstore.compaction.compact import compact_branch
    from ckstore.remote.compaction import compact_remote, open_url
    from ckstore.repo import Repo
    from ckstore.repository.context import open_context as context

    pushed = Repo.init(work / "whole")
    pushed.compact_after_commit = False
    pushed.add_remote("origin", url, endpoint)
    local = Repo.init(work / "compacted")
    local.compact_after_commit = False
    rows: list[dict[str, float | str]] = []
    for n, folder in enumerate(epochs, 1):
        oid = pushed.commit(folder, message=f"epoch {n}")
        pushed.push()
        started = time.perf_counter()
        r = compact_remote(open_url(url, endpoint), oid)
        seconds = time.perf_counter() - started
        local.commit(folder, message=f"epoch {n}")
        compact_branch(context(local.path), "main")
        remote, here = remote_bytes(pushed.path), local.stats().stored_bytes
        rows.append(
            dict(
                label=f"epoch {n}",
                remote=remote,
                local=here,
                ratio=remote / here,
                read=r.read_bytes,
                sent=r.sent_bytes,
                seconds=seconds,
                load=load(),
            )
        )
        print(
            f"remote compaction epoch {n}: remote {remote / 2**20:.1f} MiB / local {here / 2**20:.1f} MiB = "
            f"{remote / here:.3f}x; read {r.read_bytes / 2**20:.1f} MiB, sent {r.sent_bytes / 2**20:.1f} MiB, "
            f"{seconds:.0f} s (load {load():.1f})",
            flush=True,
        )
    return rows


def table(runs: dict[str, list[dict[str, float | str]]], data: str) -> str:
    """The docs section: the ratio after each push, per remote kind, side by side."""
    kinds = list(runs)
    head = "| after | " + " | ".join(f"{k}: remote / local" for k in kinds) + " | push s | load (1-min) |"
    lines = [head, "|---|" + "---|" * (len(kinds) + 2)]
    for i, row in enumerate(runs[kinds[0]]):
        cells = []
        for k in kinds:
            r = runs[k][i]
            cells.append(
                f"**{r['ratio']:.3f}×** ({float(r['remote']) / 2**20:.1f} / {float(r['local']) / 2**20:.1f} MiB)"
            )
        secs = " / ".join(f"{float(runs[k][i]['seconds']):.1f}" for k in kinds)
        loads = " / ".join(f"{float(runs[k][i]['load']):.0f}" for k in kinds)
        lines.append(f"| {row['label']} | " + " | ".join(cells) + f" | {secs} | {loads} |")
    return f"{data}\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("epochs", nargs="*", type=Path)
    parser.add_argument("--real", type=Path, metavar="WORK", help="MiniLM fp32 fine-tune epochs cached in WORK")
    parser.add_argument("--epochs", dest="count", type=int, default=4, help="with --real: how many epochs")
    parser.add_argument("--stand-in", type=int, metavar="N", help="N epochs of a small real AdamW fine-tune instead")
    parser.add_argument("--kinds", nargs="+", default=["dir", "s3"], choices=["dir", "s3"])
    parser.add_argument(
        "--remote-compaction", action="store_true", help="measure compact_remote instead (folder remote)"
    )
    parser.add_argument("--write-docs", type=Path, help="replace this run's section of the benchmarks page")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pace-"))
    data = f"{len(args.epochs)} epoch folders given"
    if args.real:
        from bench_data import ensure_checkpoints

        args.epochs = ensure_checkpoints(args.real / "checkpoints", args.count, 60, ("fp32_full",))["fp32_full"]
        data = f"all-MiniLM-L6-v2 fp32 full fine-tune, 60 AdamW steps between epochs, {args.count} epochs"
    elif args.stand_in:
        args.epochs = stand_in_epochs(work / "epochs", args.stand_in)
        data = f"stand-in AdamW fine-tune (MLP 1024→2048→1024, fp32, 60 steps an epoch), {args.stand_in} epochs"
    if not args.epochs:
        parser.error("give epoch folders, --real WORK or --stand-in N")
    runs: dict[str, list[dict[str, float | str]]] = {}
    if args.remote_compaction:
        try:
            rows = run_remote_compaction(str(work / "remote"), None, args.epochs, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        lines = [
            "| after | remote / local | read from the remote MiB | sent MiB | s | load |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['label']} | **{float(r['ratio']):.3f}×** ({float(r['remote']) / 2**20:.1f} / "
                f"{float(r['local']) / 2**20:.1f} MiB) | {float(r['read']) / 2**20:.1f} | {float(r['sent']) / 2**20:.1f} "
                f"| {float(r['seconds']):.0f} | {float(r['load']):.0f} |"
            )
        print(f"{data}\n\n" + "\n".join(lines))
        return
    try:
        print(f"{len(args.epochs)} epochs, load {load():.1f}", flush=True)
        if "dir" in args.kinds:
            runs["folder"] = run("dir", str(work / "remote"), None, args.epochs, work)
        if "s3" in args.kinds:
            (work / "server").mkdir()
            with seaweedfs(work / "server") as server:
                os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = (
                    server.access_key,
                    server.secret_key,
                )
                runs["S3 (SeaweedFS)"] = run("s3", f"s3://{server.bucket}/pace", server.endpoint, args.epochs, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    body = table(runs, data)
    print(body)
    if args.write_docs:
        write_section(args.write_docs, f"A remote fed by push alone: {len(args.epochs)} epochs", body)


if __name__ == "__main__":
    main()

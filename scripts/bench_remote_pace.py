"""A remote fed by ``ckstore push`` alone: its bytes against the local repository's, per epoch.

    python scripts/bench_remote_pace.py EPOCH_DIR... | --stand-in N  [--grace 2] [--kinds dir s3] [--before]

Commits each epoch folder (model and optimizer safetensors, e.g. the all-MiniLM-L6-v2 fp32
fine-tune epochs scripts/bench.py caches in WORK/checkpoints/s60/fp32_full/epochN) the way the
CLI does (the compaction after each commit detached, so a push may run before it finished), and
pushes after every commit; then ``ckstore wait`` and a push, and (the grace period later) one
more push, which deletes what the last one found superseded. Prints the remote's bytes (every
key: packs, indexes, refs, lists) over the local store's stored bytes after each push, for a
folder remote and an S3 one (the bundled SeaweedFS server), with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ckstore.remote.names import open_remote  # noqa: E402
from ckstore.repo import Repo  # noqa: E402
from ckstore.repository.context import open_context  # noqa: E402
from ckstore.transport.testserver import seaweedfs  # noqa: E402


def remote_bytes(repo: Repo) -> int:
    return sum(info.size for info in open_remote(open_context(repo.path)).transport.list(""))


def load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def run(kind: str, url: str, endpoint: str | None, epochs: list[Path], work: Path, grace: float) -> None:
    repo = Repo.init(work / f"repo-{kind}")
    repo.detach_compaction = True
    repo.add_remote("origin", url, endpoint)

    def show(label: str, seconds: float) -> None:
        remote, local = remote_bytes(repo), repo.stats().stored_bytes
        print(
            f"{kind} {label}: remote {remote / 2**20:.1f} MiB / local {local / 2**20:.1f} MiB = {remote / local:.3f}x"
            f" (push {seconds:.1f} s; load {load()})",
            flush=True,
        )

    for n, folder in enumerate(epochs, 1):
        repo.commit(folder, message=f"epoch {n}")
        started = time.perf_counter()
        repo.push(grace=grace)
        show(f"epoch {n} pushed", time.perf_counter() - started)
    repo.wait_background()
    started = time.perf_counter()
    repo.push(grace=grace)
    show("after wait + push", time.perf_counter() - started)
    time.sleep(grace + 0.5)
    started = time.perf_counter()
    repo.push(grace=grace)
    show("a grace later, push", time.perf_counter() - started)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("epochs", nargs="*", type=Path)
    parser.add_argument(
        "--stand-in", type=int, metavar="N", help="make N epochs of a small real AdamW fine-tune instead"
    )
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--kinds", nargs="+", default=["dir", "s3"], choices=["dir", "s3"])
    parser.add_argument("--before", action="store_true", help="the baseline: push without supersession")
    args = parser.parse_args()
    if args.before:
        import ckstore.remote.supersede as supersession

        supersession.supersede = lambda *_, **__: None
    work = Path(tempfile.mkdtemp(prefix="pace-"))
    if args.stand_in:
        args.epochs = stand_in_epochs(work / "epochs", args.stand_in)
    if not args.epochs:
        parser.error("give epoch folders or --stand-in N")
    try:
        print(f"{len(args.epochs)} epochs, grace {args.grace} s, load {load()}", flush=True)
        if "dir" in args.kinds:
            run("dir", str(work / "remote"), None, args.epochs, work, args.grace)
        if "s3" in args.kinds:
            (work / "server").mkdir()
            with seaweedfs(work / "server") as server:
                os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = (
                    server.access_key,
                    server.secret_key,
                )
                run("s3", f"s3://{server.bucket}/pace", server.endpoint, args.epochs, work, args.grace)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

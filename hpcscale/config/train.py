"""The built-in trainer's parameters (`train.params` in a job spec). Torch-free, so login-node commands
(`config validate`, `submit`) check them with file:line: key errors before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from hpcscale.config.fields import setting
from hpcscale.config.job import ModelSize
from hpcscale.layout import ParallelDims


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Parameters of the reference GPT trainer (`train.entry: builtin`)."""

    steps: int = setting("Optimizer steps to train.", default=300, min=1)
    global_batch: int = setting(
        "Samples per optimizer step over all dp ranks; fixed across layouts.", default=16, min=1
    )
    micro_batch: int = setting(
        "Samples per micro-batch on one dp rank; global_batch / (dp × micro_batch) "
        "micro-batches are accumulated (and pipelined) per step.",
        default=4,
        min=1,
    )
    seq_len: int = setting("Tokens per sample (context length).", default=64, min=2)
    n_layer: int = setting("Transformer blocks; at least pp.", default=4, min=1)
    n_embd: int = setting("Model width; a multiple of n_head.", default=64, min=8)
    n_head: int = setting("Attention heads; a multiple of tp.", default=4, min=1)
    lr: float = setting("Peak learning rate (AdamW).", default=3e-3, min=0)
    min_lr: float = setting("Learning rate at the end of the cosine decay.", default=3e-4, min=0)
    warmup_steps: int = setting("Linear warmup steps before the cosine decay.", default=20, min=0)
    weight_decay: float = setting(
        "AdamW weight decay (matrices only; not norms, biases, embeddings).", default=0.1, min=0
    )
    beta1: float = setting("AdamW beta1.", default=0.9, min=0, max=1)
    beta2: float = setting("AdamW beta2.", default=0.95, min=0, max=1)
    grad_clip: float = setting(
        "Clip the global gradient norm to this (across tp and pp); 0 turns it off.", default=1.0, min=0
    )
    seed: int = setting("Seed for model init and data order.", default=1234, min=0)
    schedule: Literal["1f1b", "gpipe"] = setting("Pipeline schedule when pp > 1.", default="1f1b")
    eval_every: int = setting("Validation loss every N steps (and at the end); 0 turns it off.", default=50, min=0)
    eval_batches: int = setting("Global batches of held-out samples per validation.", default=2, min=1)
    val_fraction: float = setting(
        "Share of samples held out for validation: the dataset's last samples, a seeded sample of whole documents "
        "(data prepare shuffles the document order).",
        default=0.02,
        min=0,
        max=0.5,
    )
    log_every: int = setting("Print progress every N steps (metrics.jsonl gets every step).", default=10, min=1)
    bf16: bool = setting("bf16 autocast on GPUs (ignored on CPU, where runs stay fp32).", default=False)
    tf32: bool = setting(
        "TF32 tensor cores for fp32 matmuls and convolutions on GPUs (Ampere and newer): several times faster "
        "than full fp32, with a 10-bit mantissa in the products. Ignored on CPU.",
        default=False,
    )
    fused_optimizer: bool = setting(
        "One fused AdamW kernel over all parameters instead of one kernel chain per parameter: much faster "
        "on GPUs at scale (torch's CPU kernel runs it on CPU ranks too). Off, each parameter is updated on its "
        "own, so results do not depend on how parameters are grouped (the bitwise layout equivalence).",
        default=False,
    )
    deterministic: bool = setting(
        "torch.use_deterministic_algorithms: the same inputs give bitwise the same results (resume reproduces "
        "the uninterrupted run). On GPUs it picks slower deterministic kernels and hpcscale sets "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless set) as cuBLAS then requires; turn it off for speed.",
        default=True,
    )


def train_checks(cfg: TrainConfig, *, dims: ParallelDims) -> list[tuple[str, str]]:
    """(key, message) for every rule across keys and the parallel layout."""
    dp, tp, pp = dims.dp, dims.tp, dims.pp
    out = []
    if cfg.n_embd % cfg.n_head:
        out.append(("n_embd", f"n_embd({cfg.n_embd}) is not a multiple of n_head({cfg.n_head})"))
    if cfg.n_head % tp:
        out.append(("n_head", f"n_head({cfg.n_head}) is not a multiple of tp({tp})"))
    if cfg.n_layer < pp:
        out.append(("n_layer", f"n_layer({cfg.n_layer}) < pp({pp}): a stage would have no layer"))
    if cfg.global_batch % (dp * cfg.micro_batch):
        out.append(
            (
                "global_batch",
                f"global_batch({cfg.global_batch}) is not a multiple of dp({dp}) * micro_batch({cfg.micro_batch})",
            )
        )
    elif pp > 1 and cfg.schedule == "1f1b" and cfg.global_batch // (dp * cfg.micro_batch) < pp:
        out.append(
            (
                "global_batch",
                f"{cfg.global_batch // (dp * cfg.micro_batch)} micro-batches per step is "
                f"fewer than pp({pp}); 1F1B needs at least one per stage",
            )
        )
    if cfg.min_lr > cfg.lr:
        out.append(("min_lr", f"min_lr({cfg.min_lr}) is above lr({cfg.lr})"))
    return out


def model_size(spec) -> ModelSize | None:
    """The model's size placement's traffic model takes (config.job.ModelSize): the job's `model:` when it declares
    one; for the built-in trainer, from its train.params (n_layer, n_embd, seq_len, micro_batch, global_batch, and
    vocab_size where given); None otherwise (placement's default ratios). The traffic model itself knows no
    model's parameter names."""
    if spec.model is not None:
        return spec.model
    train = spec.train
    if train is None or train.entry != "builtin":
        return None
    p = {f.name: f.default for f in fields(TrainConfig)} | dict(train.params or {})
    try:
        return ModelSize(
            layers=int(p["n_layer"]),
            hidden=int(p["n_embd"]),
            seq_len=int(p["seq_len"]),
            micro_batch=int(p["micro_batch"]),
            global_batch=int(p["global_batch"]),
            vocab=int(p.get("vocab_size", 256)),
        )
    except (TypeError, ValueError):  # config validate says what is wrong with them; placement uses the ratios
        return None

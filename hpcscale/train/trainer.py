"""The built-in trainer (`train.entry: builtin`): the reference GPT at any (tp, pp, dp).

The job's global batch fixes the optimisation: every layout sees the same samples per step and averages the
same gradients, so changing the layout changes speed, never the losses (tests/training/test_train_layouts.py).

The trainer is an entry point like any user's: its model is placed by `ctx.parallelize`, its pipeline run by
`ctx.pipeline`, its checkpoints kept by `ctx.checkpoint`. Order of construction, and why:
1. build the whole model on the meta device (shapes, no storage: no rank ever holds the whole model);
2. cut the pipeline stage: the stage keeps its layers' original names;
3. ctx.parallelize: tensor parallelism from the model's plan, then the data parallelism (gradient averaging
   over replicas, or with parallel.dp_shard > 1 FSDP2 per block, with the job's activation checkpointing and
   mixed precision), then each rank allocates and initializes its own shards, seeded by parameter name, so
   every layout starts from the weights of the model built whole on one process;
4. the optimizer last, over the final (sharded) parameters; with pp > 1, the schedule (ctx.pipeline).

Gradient accumulation at pp = 1 (the micro-batches before the last run under ctx.accumulate): replicated data
parallelism all-reduces once per step; FSDP2 reduce-scatters each micro-batch's gradients as backward produces
them, which keeps them sharded (under no_sync they would be held whole until the last micro-batch), and HSDP
all-reduces across its replicas once per step. At pp > 1 the pipeline schedule accumulates and reduces once per
step in every case.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from hpcscale.config.decode import Decoder
from hpcscale.config.train import TrainConfig, train_checks
from hpcscale.config.yamlsrc import YamlSource
from hpcscale.data.loader import TokenLoader
from hpcscale.data.prepare import default_corpus_dataset
from hpcscale.launch import mpiwait
from hpcscale.launch.context import Context
from hpcscale.parallel.fsdp import reshard
from hpcscale.parallel.pipeline import cut_stage
from hpcscale.rundir import JOB
from hpcscale.train.model import GPT, GPTShape, lm_loss
from hpcscale.util.paths import expand_path


def load_config(ctx: Context) -> TrainConfig:
    dec = Decoder(YamlSource(str(ctx.run_dir / JOB), ctx.params))
    cfg = dec.decode(TrainConfig, ctx.params, ("train", "params"))
    dec.raise_if_any()
    for key, message in train_checks(cfg, dims=ctx.dims):
        dec.error(("train", "params", key), message)
    dec.raise_if_any()
    return cfg


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def build_model(cfg: TrainConfig, ctx: Context, vocab_size: int) -> GPT:
    torch.manual_seed(cfg.seed)  # whatever draws from torch's RNG after the model (its init is seeded by name)
    shape = GPTShape(
        vocab_size=vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head
    )
    with torch.device("meta"):
        model = GPT(shape)
    cut_stage(
        model,
        stage=ctx.pp_rank,
        pp=ctx.dims.pp,
        first_stage_only=GPT.FIRST_STAGE_ONLY,
        last_stage_only=GPT.LAST_STAGE_ONLY,
    )
    setting = ctx.job.parallel.mixed_precision
    bf16 = cfg.bf16 and ctx.device.type == "cuda"
    return ctx.parallelize(
        model,
        tp_plan=model.tp_plan() if ctx.dims.tp > 1 else None,
        blocks=list(model.layers.values()),
        init=model.init_module,
        seed=cfg.seed,
        # auto: bf16 only where the job asked the trainer for bf16 (train.params.bf16) and runs on a GPU
        mixed_precision=setting if setting != "auto" else ("bf16" if bf16 else "fp32"),
    )


def build_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.fused_optimizer:  # torch has the fused kernel on CPU too, so a CPU run tests what a GPU runs
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)
    # foreach=False: the per-parameter kernels are bitwise independent of how parameters are grouped, which
    # the layout-equivalence guarantee relies on.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, foreach=False)


def set_numerics(cfg: TrainConfig, device: torch.device) -> None:
    """Determinism and TF32 as the job asks, before the first matmul. cuBLAS refuses to run deterministically
    without CUBLAS_WORKSPACE_CONFIG, and reads it when its first handle is made: set here, it is in time."""
    import os

    if cfg.deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(cfg.deterministic)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


def dataset_manifest(ctx: Context, cfg: TrainConfig):
    if ctx.job.data.manifest:
        return expand_path(ctx.job.data.manifest)
    # No dataset named: Python's standard library sources, prepared once in scratch (rank 0 prepares).
    from mpi4py import MPI

    scratch = ctx.scratch or ctx.run_dir
    path = None
    if MPI.COMM_WORLD.rank == 0:
        path = default_corpus_dataset(scratch, sample_len=max(257, cfg.seq_len + 1))
    return mpiwait.bcast(path, root=0)


def _efficiency_words(figures: dict[str, float]) -> str:
    """The step line's efficiency: MFU (or TFLOPS per device where no peak is known) and the device memory peak."""
    words = ""
    if "mfu" in figures:
        words += f"  MFU {100 * figures['mfu']:4.1f}%"
    elif "tflops" in figures:
        words += f"  {figures['tflops']:.3g} TFLOPS/dev"
    if "mem_gb" in figures:
        words += f"  mem {figures['mem_gb']:.1f} GB"
    return words


def train(ctx: Context) -> None:
    cfg = load_config(ctx)
    dims = ctx.dims
    set_numerics(cfg, ctx.device)
    loader = TokenLoader(
        dataset_manifest(ctx, cfg),
        seq_len=cfg.seq_len,
        global_batch=cfg.global_batch,
        dp_rank=ctx.dp_rank,
        dp_size=dims.dp,
        seed=cfg.seed,
        val_fraction=cfg.val_fraction,
    )
    n_micro = cfg.global_batch // (dims.dp * cfg.micro_batch)
    last = ctx.pp_rank == dims.pp - 1

    def build():
        """The model, optimizer and pipeline, as a fresh start has them: the model's initialisation is seeded,
        so building again gives the same values."""
        model = build_model(cfg, ctx, loader.vocab_size)
        opt = build_optimizer(model, cfg, ctx.device)
        pipe = None
        if dims.pp > 1:
            pipe = ctx.pipeline(model, n_microbatches=n_micro, loss_fn=lm_loss, schedule=cfg.schedule)
        return model, opt, pipe

    model, opt, pipe = build()

    def rebuild():
        """Every checkpoint was refused, one after part of it was read into the model: build it again."""
        nonlocal model, opt, pipe
        model, opt, pipe = build()
        ctx.metrics.print("hpcscale: no checkpoint loaded; the model and optimizer were built again from the seed")
        return model, opt

    # The checkpoints, the stop protocol, periodic and `auto` saves, per-rank timing and cross-site rounds are
    # ctx.checkpoint's, as for any entry point; the trainer adds what only it knows.
    checkpoint = ctx.checkpoint
    checkpoint.steps = cfg.steps
    tokens_per_step = checkpoint.tokens_per_step = cfg.global_batch * cfg.seq_len
    checkpoint.defer_staging = True  # an async save's copy overlaps the next forward and backward
    checkpoint.rebuild = rebuild
    start = checkpoint.restore(model, opt, loader=loader)

    autocast = ctx.device.type == "cuda" and cfg.bf16
    ctx.metrics.print(
        f"hpcscale: GPT {cfg.n_layer}x{cfg.n_embd} on {dims.world_size} ranks "
        f"({dims.text()}), {n_micro} micro-batches/step, "
        f"{cfg.steps} steps, backend {ctx.backend}"
    )

    def run_batch(inputs: torch.Tensor, targets: torch.Tensor, *, training: bool) -> torch.Tensor:
        """Mean loss of this dp rank's batch on the last stage (0 elsewhere); backward when training."""
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
            if pipe is None:
                total = torch.zeros((), device=ctx.device)
                micro = list(zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True))
                for i, (x, y) in enumerate(micro):
                    if training:
                        with ctx.accumulate() if i < n_micro - 1 else contextlib.nullcontext():
                            loss = lm_loss(model(x), y) / n_micro
                            loss.backward()
                    else:
                        with torch.no_grad():
                            loss = lm_loss(model(x), y) / n_micro
                    total += loss.detach()
                return total
            loss = (pipe.step if training else pipe.eval)(inputs, targets)
            return loss if loss is not None else torch.zeros((), device=ctx.device)

    def contribution(loss: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global mean loss (last stage, tp rank 0 of each dp replica): summed over
        every rank it is the mean."""
        return loss / dims.dp if (last and ctx.tp_rank == 0) else torch.zeros((), device=ctx.device)

    def agree(loss: torch.Tensor) -> float:
        """The global mean loss: one all-reduce (evaluation; a training step's rides on the stop check's)."""
        t = contribution(loss).float().reshape(1)
        dist.all_reduce(t)
        return float(t[0])

    pin = ctx.device.type == "cuda"

    def to_device(batch):
        """The batch on the rank's device. On a GPU from pinned memory, asynchronously: a copy from pageable
        memory would make the host wait for everything queued on the stream first."""
        tensors = (torch.from_numpy(a) for a in batch)
        return tuple((t.pin_memory() if pin else t).to(ctx.device, non_blocking=pin) for t in tensors)

    def evaluate(step: int) -> None:
        batches = loader.val_batches(cfg.eval_batches)
        if not batches:
            return
        model.eval()
        total = 0.0
        for batch in batches:
            total += agree(run_batch(*to_device(batch), training=False))
        reshard(model)  # the no-grad forwards left the last block's parameters gathered
        model.train()
        val = total / len(batches)
        ctx.metrics.log(step=step, val_loss=val)
        ctx.metrics.print(f"step {step:6d}  val_loss {val:.4f}")

    def log_step(
        values: dict[str, float], *, step: int, lr: float, t0: float, t_check: float, comm_before: float
    ) -> None:
        """The step's line, from the loss and norm the stop check's all-reduce brought back."""
        t_end = time.perf_counter()
        step_s = t_end - t0
        comm_s = comm_before + (t_end - t_check)  # the check waits for the slowest rank's step too
        loss_value = values["loss"]
        efficiency = checkpoint.efficiency(step_s)
        ctx.metrics.log(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=values["grad_norm"],
            step_time_s=step_s,
            tokens_per_s=tokens_per_step / step_s,
            comm_share=comm_s / step_s,
            loader=asdict(loader.state),
            **efficiency,
        )
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            left = (cfg.steps - step - 1) * step_s  # at this step's pace
            ctx.metrics.print(
                f"step {step:6d}  loss {loss_value:.4f}  lr {lr:.2e}  {step_s * 1000:6.1f} ms/step  "
                f"{tokens_per_step / step_s:8.0f} tok/s{_efficiency_words(efficiency)}  "
                f"{cfg.steps - step - 1} steps left, about "
                f"{int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"
            )

    step = start
    while step < cfg.steps:
        t0 = time.perf_counter()
        inputs, targets = to_device(loader.next_batch())
        data_s = time.perf_counter() - t0
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        synced_before = ctx.grad_sync_wait_s
        loss = run_batch(inputs, targets, training=True)
        grad_norm = ctx.clip_grad_norm_(cfg.grad_clip)  # a device tensor: read with the stop flag below
        opt.step()  # after a deferred save's copy of the tensors is taken (ctx.checkpoint's pre-step hook)
        comm_before = ctx.grad_sync_wait_s - synced_before  # this step's wait for the gradient averaging
        t_check = time.perf_counter()
        # the norm is the same on every rank: rank 0's alone makes the sum exact
        norm_share = grad_norm if ctx.rank == 0 else torch.zeros((), device=ctx.device)
        sums = {"loss": contribution(loss), "grad_norm": norm_share}
        # watchdog, stop signal, periodic save, round, per-rank timing; the step's line is logged by log_step()
        # after the stop check's all-reduce, which also sums the loss and the norm: one host sync per step
        at = {"step": step, "lr": lr, "t0": t0, "t_check": t_check, "comm_before": comm_before}
        # the next step: this one's successor, or after a rollback (train.on_spike) the checkpoint's step
        following = checkpoint.step(step, data_s=data_s, sums=sums, report=functools.partial(log_step, **at))
        if following is None:  # a wrapper of ctx.checkpoint.step that drops its answer: no rollback came through it
            following = step + 1
        if following == step + 1 and cfg.eval_every and following % cfg.eval_every == 0 and step != cfg.steps - 1:
            with checkpoint.paused("evaluation"):
                evaluate(step)
        step = following
    if cfg.eval_every and start < cfg.steps:
        with checkpoint.paused("evaluation"):
            evaluate(cfg.steps - 1)
    # the end state's checkpoint (with a checkpoint period, or a cross-site site's last round) is saved by
    # ctx.checkpoint when this returns, after the final evaluation

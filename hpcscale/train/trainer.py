"""The built-in trainer (`train.entry: builtin`): the reference GPT at any (tp, pp, dp).

The job's global batch fixes the optimisation: every layout sees the same samples per step and averages the
same gradients, so changing the layout changes speed, never the losses (tests/test_train_layouts.py).

Order of construction, and why:
1. build the whole model on every rank from the same seed: identical weights everywhere;
2. cut the pipeline stage: the stage keeps its layers' original names (and init);
3. apply tensor parallelism: DTensor shards the kept weights from those identical full tensors;
4. with parallel.dp_shard > 1, FSDP2 shards each block over the data-parallel mesh (hpcscale.parallel.fsdp,
   the same call ctx.parallelize makes), with the job's activation checkpointing and mixed precision;
5. gradient sync hooks (replicated dp; FSDP reduce-scatters itself) and the optimizer last, over the final
   (sharded) parameters.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from hpcscale.ckpt.rng import restore_rng
from hpcscale.config.decode import Decoder
from hpcscale.config.train import TrainConfig, train_checks
from hpcscale.config.yamlsrc import YamlSource
from hpcscale.data.loader import TokenLoader
from hpcscale.data.prepare import default_corpus_dataset
from hpcscale.launch.context import Context
from hpcscale.launch.signals import StopRequested
from hpcscale.launch.timing import NoStepTimes, SaveSchedule
from hpcscale.launch.watchdog import NoWatchdog
from hpcscale.parallel.clip import clip_grad_norm
from hpcscale.parallel.device import settle
from hpcscale.parallel.fsdp import ShardedSync, reshard, shard_model
from hpcscale.parallel.grad_sync import GradSync
from hpcscale.parallel.pipeline import build_schedule, cut_stage
from hpcscale.parallel.tensor_parallel import apply_tp
from hpcscale.rundir import CHECKPOINTS, JOB
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
    torch.manual_seed(cfg.seed)
    shape = GPTShape(
        vocab_size=vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head
    )
    model = GPT(shape)
    cut_stage(
        model,
        stage=ctx.pp_rank,
        pp=ctx.dims.pp,
        first_stage_only=GPT.FIRST_STAGE_ONLY,
        last_stage_only=GPT.LAST_STAGE_ONLY,
    )
    model.to(ctx.device)
    apply_tp(model, tp_mesh=ctx.mesh["tp"])
    p = ctx.job.parallel
    shard_model(
        model,
        mesh=ctx.mesh,
        dims=ctx.dims,
        device=ctx.device,
        blocks=list(model.layers.values()),
        reshard_after_forward=p.reshard_after_forward,
        # auto: bf16 only where the job asked the trainer for bf16 (train.params.bf16) and runs on a GPU
        mixed_precision=p.mixed_precision if p.mixed_precision != "auto" else ("bf16" if cfg.bf16 else "fp32"),
        activation_checkpointing=p.activation_checkpointing,
    )
    return model


def build_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (cfg.beta1, cfg.beta2)
    if cfg.fused_optimizer and device.type == "cuda":
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
    return MPI.COMM_WORLD.bcast(path, root=0)


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step would create it (zeros), so a checkpoint has somewhere to load into.
    Bitwise the same as letting AdamW create it lazily."""
    for group in opt.param_groups:
        # the fused kernel keeps its step counts on the parameters' device (torch's own lazy init does too)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Everything a checkpoint holds for the model and optimizer, by stable global names."""
    reshard(model)  # FSDP2 units an evaluation left gathered hold full tensors, not the optimizer's shards
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model/{n}": p for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"optim/{names[id(p)]}/{key}"] = value
    return out


def trainer_state_problem(state: dict) -> str | None:
    """What is wrong with a checkpoint's trainer state for this trainer (None: usable). It reads
    state["loader"] and hands it to TokenLoader.load_state_dict: "epoch" and "batch" non-negative integers and
    "seed", when present, an integer (a different seed is the user's choice, reported by the loader)."""
    loader = state.get("loader")
    if not isinstance(loader, dict):
        return f"loader is {type(loader).__name__}, not an object with epoch, batch and seed"
    for key in ("epoch", "batch"):
        value = loader.get(key)
        if type(value) is not int or value < 0:
            return f"loader.{key} is {str(value)[:40]!r}, not a non-negative integer"
    if "seed" in loader and type(loader["seed"]) is not int:
        return f"loader.seed is {str(loader['seed'])[:40]!r}, not an integer"
    return None


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
    dp_group = ctx.mesh["dp"].get_group() if dims.dp > 1 else None
    first, last = ctx.pp_rank == 0, ctx.pp_rank == dims.pp - 1

    def build():
        """The model, its gradient sync, optimizer (state made) and pipeline schedule, as a fresh start has them:
        the model's initialisation is seeded, so building again gives the same values."""
        model = build_model(cfg, ctx, loader.vocab_size)
        sync = ShardedSync(model) if dims.sharded else GradSync(model, dp_group)
        opt = build_optimizer(model, cfg, ctx.device)
        schedule = None
        if dims.pp > 1:
            schedule = build_schedule(
                model, pp_mesh=ctx.mesh["pp"], n_microbatches=n_micro, kind=cfg.schedule, loss_fn=lm_loss,
                device=ctx.device,
            )  # fmt: skip
        init_optimizer_state(opt)
        return model, sync, opt, schedule

    model, sync, opt, schedule = build()
    policy = ctx.job.checkpoint
    from hpcscale.ckpt import lineage
    from hpcscale.ckpt.manager import CheckpointManager

    ckpt = CheckpointManager(
        ctx.run_dir / CHECKPOINTS,
        dims=dims,
        rank=ctx.rank,
        keep_last=policy.keep_last,
        keep_every=policy.keep_every,
        direct_io=policy.direct_io,
        background_nice=policy.background_nice,
        log=ctx.metrics.print,
        lineage=lineage.of_context(ctx),
        device=ctx.device,
        timeout_s=ctx.job.timeout_seconds,
        owner=ctx.run_id,
    )
    ctx.hooks["checkpoint"] = ckpt
    start = 0
    # restore_s is the load alone: the ranks meet first, so one still starting up (cold imports) is not in it
    dist.barrier()
    t_restore = time.perf_counter()
    restored = ckpt.load_latest(state_tensors(model, opt), check_state=trainer_state_problem)
    if restored is None and ckpt.tensors_dirty:  # a refused checkpoint was partly read into them: build afresh
        model, sync, opt, schedule = build()
        ctx.metrics.print("hpcscale: no checkpoint loaded; the model and optimizer were built again from the seed")
    params = [p for p in model.parameters() if p.requires_grad]
    if restored is not None:
        start = restored.step
        ctx.metrics.log(step=start - 1, restored_from=start, restore_s=round(time.perf_counter() - t_restore, 4))
        loader.load_state_dict(restored.trainer_state["loader"])
        if restored.rng is not None:
            restore_rng(restored.rng, ctx.device)
        ctx.metrics.print(
            f"hpcscale: resumed from checkpoint step {start}"
            + ("" if restored.rng is not None else " (new layout: resharded)")
        )

    pretrained = None  # xsite.start_from: a fresh site starts from that checkpoint (weights, optimizer, step)
    if restored is None and ctx.job.xsite is not None and ctx.job.xsite.start_from:
        from hpcscale.launch.rounds import load_start_from

        pretrained = load_start_from(
            ctx, dims, state_tensors(model, opt), check_state=trainer_state_problem, steps=cfg.steps
        )
        start = pretrained.step

    wd = ctx.hooks.get("watchdog") or NoWatchdog()  # launch's progress watchdog; none without launch
    times = ctx.hooks.get("timing") or NoStepTimes()  # per-rank breakdown into RUN/timing.jsonl
    saves = SaveSchedule(
        policy.every_steps, start=start, mtbf=ctx.hooks.get("mtbf"), log=ctx.metrics.log, say=ctx.metrics.print
    )
    rounds = None
    if ctx.job.xsite is not None:  # one site of a cross-site training (hpcscale.launch.rounds)
        from hpcscale.launch.rounds import Rounds
        from hpcscale.xsite.rounds import TAG

        rounds = Rounds(ctx, model, tokens_per_step=cfg.global_batch * cfg.seq_len)
        if restored is not None:
            rounds.restore(restored.trainer_state)
        elif pretrained is not None:
            rounds.begin_at(start)

    def save(done_steps: int, *, asynchronous: bool) -> tuple[float, float | None]:
        """Save; returns the seconds the loop was blocked (the wait for the save before included) and how long
        the save before wrote in the background (None: it did not)."""
        state = {"step": done_steps, "loader": loader.state_dict()}
        if rounds is not None:  # lineage: every checkpoint names the global round its weights started from
            state[TAG] = rounds.tag(done_steps)
        with wd.paused("checkpoint"):
            t = time.perf_counter()
            ckpt.wait()
            waited = time.perf_counter() - t
            before = ckpt.last_stats
            # asynchronous: even the copy to host buffers runs in the background; the loop waits for it only
            # before the optimizer step, the next change to the saved tensors (ckpt.wait_staged below)
            stats = ckpt.save(
                done_steps, state_tensors(model, opt), state, asynchronous=asynchronous, defer_staging=asynchronous
            )
        blocking = waited + stats.blocking_s
        ctx.metrics.log(step=done_steps - 1, checkpoint=done_steps, checkpoint_blocking_s=round(blocking, 6))
        return blocking, (before.background_s or None) if before is not None else None

    def round_boundary(done_steps: int) -> None:
        """Save the round checkpoint the sync tick exports, then wait for the next global round (or, with
        adopt: overlap, train on and adopt it when it lands: hpcscale.launch.rounds)."""
        with wd.paused("cross-site round"):
            rounds.boundary(done_steps, lambda: (save(done_steps, asynchronous=False), ckpt.wait()))

    if rounds is not None and restored is None:
        round_boundary(start)  # the start checkpoint (the aggregator's becomes round 0), then adopt θ(0)
    elif rounds is not None and rounds.is_boundary(start):
        with wd.paused("cross-site round"):  # resumed from a round checkpoint: the wait it was killed in
            rounds.wait_and_adopt(start)
    elif rounds is not None:  # overlap, restarted mid-round: the boundary's weights back from its checkpoint
        rounds.rebuild_snapshot(start, ctx.run_dir / CHECKPOINTS)

    autocast = ctx.device.type == "cuda" and cfg.bf16
    tokens_per_step = cfg.global_batch * cfg.seq_len
    shard = f" dp_shard={dims.dp_shard}" if dims.sharded else ""
    ctx.metrics.print(
        f"hpcscale: GPT {cfg.n_layer}x{cfg.n_embd} on {dims.world_size} ranks "
        f"(pp={dims.pp} dp={dims.dp}{shard} tp={dims.tp}), {n_micro} micro-batches/step, "
        f"{cfg.steps} steps, backend {ctx.backend}"
    )

    def run_batch(inputs: torch.Tensor, targets: torch.Tensor, *, training: bool) -> torch.Tensor:
        """Mean loss of this dp rank's batch on the last stage (0 elsewhere); backward when training."""
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
            if schedule is None:
                total = torch.zeros((), device=ctx.device)
                for x, y in zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True):
                    if training:
                        loss = lm_loss(model(x), y) / n_micro
                        loss.backward()
                    else:
                        with torch.no_grad():
                            loss = lm_loss(model(x), y) / n_micro
                    total += loss.detach()
                return total
            losses: list[torch.Tensor] = []
            run = schedule.step if training else schedule.eval
            if first:
                run(inputs)
            elif last:
                run(target=targets, losses=losses)
            else:
                run()
            # each micro-batch's loss is already divided by n_micro (build_schedule): their sum is the mean
            return torch.stack(losses).sum().detach() if last else torch.zeros((), device=ctx.device)

    def agree(loss: torch.Tensor, extra: float = 0.0) -> tuple[float, float]:
        """One all-reduce per step: the global mean loss (last stage, tp rank 0 of each dp replica) and a flag."""
        contribution = loss / dims.dp if (last and ctx.tp_rank == 0) else torch.zeros((), device=ctx.device)
        t = torch.stack([contribution.float(), torch.tensor(extra, device=ctx.device)])
        dist.all_reduce(t)
        return float(t[0]), float(t[1])

    def to_device(batch):
        return tuple(torch.from_numpy(a).to(ctx.device) for a in batch)

    def evaluate(step: int) -> None:
        batches = loader.val_batches(cfg.eval_batches)
        if not batches:
            return
        model.eval()
        total = 0.0
        for batch in batches:
            total += agree(run_batch(*to_device(batch), training=False))[0]
        reshard(model)  # the no-grad forwards left the last block's parameters gathered
        model.train()
        val = total / len(batches)
        ctx.metrics.log(step=step, val_loss=val)
        ctx.metrics.print(f"step {step:6d}  val_loss {val:.4f}")

    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        inputs, targets = to_device(loader.next_batch())
        data_s = time.perf_counter() - t0
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        sync.begin(n_micro)
        loss = run_batch(inputs, targets, training=True)
        sync.finish()
        grad_norm = clip_grad_norm(
            params,
            cfg.grad_clip,
            pp_group=ctx.mesh["pp"].get_group() if dims.pp > 1 else None,
            device=ctx.device,
        )
        ckpt.wait_staged()  # a save's copy of the weights and optimizer state is taken before they change
        opt.step()
        settle(ctx.device)  # the step's queued kernels are done: what agree() waits for from here is its peers
        t_comm = time.perf_counter()
        loss_value, stop = agree(loss, 1.0 if ctx.stop.requested else 0.0)
        t_end = time.perf_counter()
        comm_s = sync.comm_wait_s + (t_end - t_comm)
        step_s = t_end - t0
        ctx.metrics.log(
            step=step,
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            step_time_s=step_s,
            tokens_per_s=tokens_per_step / step_s,
            comm_share=comm_s / step_s,
            loader=asdict(loader.state),
        )
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            ctx.metrics.print(
                f"step {step:6d}  loss {loss_value:.4f}  lr {lr:.2e}  {step_s * 1000:6.1f} ms/step  "
                f"{tokens_per_step / step_s:8.0f} tok/s"
            )
        wd.beat(step)
        saves.step(step_s)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step != cfg.steps - 1:
            with wd.paused("evaluation"):
                evaluate(step)
        ckpt_s = 0.0
        if rounds is not None and rounds.is_boundary(step + 1) and step != cfg.steps - 1:
            round_boundary(step + 1)
        elif saves.due(step + 1) and step != cfg.steps - 1:
            ckpt_s, background_s = save(step + 1, asynchronous=policy.asynchronous)
            saves.saved(step + 1, ckpt_s, background_s)
        times.record(
            step,
            step_s=step_s + ckpt_s,
            data_s=data_s,
            dp_wait_s=sync.comm_wait_s,
            sync_s=t_end - t_comm,
            ckpt_s=ckpt_s,
        )
        if rounds is not None and rounds.overlap and not rounds.is_boundary(step + 1):
            ckpt.wait_staged()  # adopting a round changes the weights
            rounds.poll(step + 1)  # adopt the round in flight if it has landed
        if stop > 0:
            with wd.paused("checkpoint"):
                save(step + 1, asynchronous=False)
                ckpt.wait()
            ctx.metrics.print(f"stop requested: stopping after step {step} (checkpoint saved)")
            raise StopRequested(step)
    if cfg.eval_every and start < cfg.steps:
        with wd.paused("evaluation"):
            evaluate(cfg.steps - 1)
    with wd.paused("checkpoint"):
        if rounds is not None and rounds.is_boundary(cfg.steps) and start < cfg.steps:
            rounds.before_round_checkpoint(cfg.steps)  # overlap: the round in flight first, as at every boundary
        if saves.enabled or rounds is not None:
            save(cfg.steps, asynchronous=False)  # a cross-site run's last round checkpoint too
        ckpt.close()  # waits for the save in flight, then ends the writer thread

"""A user entry point (`train.entry: fsdp_entry:main`) with its own model, trained at any layout through ctx.parallelize
and ctx.checkpoint: sharded (parallel.dp_shard), tensor-parallel (a plan for its blocks) and pipelined (cut_stage,
then ctx.pipeline on the stage ctx.parallelize placed: its replicas averaged or sharded). Every layout sees the same
global batch per step, so its losses must be the single process's.

params: steps (default 12), lr, optimizer (AdamW's kernels: loop, the default, foreach or fused), slow_rank and
slow_ms (that rank sleeps so long before each step, as behind a slow data loader), meta (build the model on the meta
device and let ctx.parallelize materialize each rank's shards with `init`; otherwise it is built whole and
initialized the same way). Clips the global gradient norm to 0.5 with ctx.clip_grad_norm_. Logs `loss` and
`grad_norm` per step (the global mean loss, the norm before clipping) and, at the end, the bytes of parameters,
gradients and optimizer state this rank holds (RUN/state_bytes.RANK) for the memory checks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from hpcscale.parallel.init import initialize
from hpcscale.parallel.pipeline import cut_stage

VOCAB, WIDTH, LAYERS, SEQ, BATCH = 50, 32, 4, 16, 8  # 50: the head and embedding shard unevenly


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Block(WIDTH) for _ in range(LAYERS)])  # cut_stage keeps global indices
        self.head = nn.Linear(WIDTH, VOCAB)
        # a buffer outside the state dict, as rotary tables are: init computes it after to_empty
        self.register_buffer("gain", torch.linspace(0.5, 1.5, WIDTH), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x) * self.gain
        for block in self.layers:
            x = block(x)
        return self.head(x) if self.head is not None else x


def init(m: nn.Module) -> None:
    """One module's own tensors (LayerNorm's come from its reset_parameters)."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight)
    elif isinstance(m, Net):
        m.gain.copy_(torch.linspace(0.5, 1.5, WIDTH))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (x * 7 + 3) % VOCAB


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    def local(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for s in opt.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in s.values() if torch.is_tensor(v))
    return total


def main(ctx):
    steps = int(ctx.params.get("steps", 12))
    meta = bool(ctx.params.get("meta", False))
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()
        initialize(model, init, seed=0)
    pp = ctx.dims.pp
    cut_stage(model, stage=ctx.pp_rank, pp=pp, first_stage_only=("emb",), last_stage_only=("head",))
    plan = None
    if ctx.dims.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {
            f"layers.{i}.{n}": s
            for i, _ in model.layers.named_children()  # this stage's blocks, by their global index
            for n, s in (("fc", ColwiseParallel()), ("proj", RowwiseParallel()))
        }
    model = ctx.parallelize(model, tp_plan=plan, init=init if meta else None, seed=0)
    # optimizer: "loop" (per-parameter kernels), "foreach" or "fused" (torch's defaults on GPUs)
    kernel = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    opt = torch.optim.AdamW(
        model.parameters(), lr=float(ctx.params.get("lr", 1e-2)), **kernel[ctx.params.get("optimizer", "loop")]
    )
    start = ctx.checkpoint.restore(model, opt)
    dp, rows = ctx.dims.dp, BATCH // ctx.dims.dp
    pipe = ctx.pipeline(model, n_microbatches=2, loss_fn=loss_fn) if pp > 1 else None
    last = pipe is None or pipe.last
    slow_rank, slow_s = int(ctx.params.get("slow_rank", -1)), float(ctx.params.get("slow_ms", 0)) / 1000
    for step in range(start, steps):
        if ctx.rank == slow_rank:  # a slow data loader on one rank: its own time, which its peers wait for
            time.sleep(slow_s)
        x, y = batch(step)
        x, y = x[ctx.dp_rank * rows : (ctx.dp_rank + 1) * rows], y[ctx.dp_rank * rows : (ctx.dp_rank + 1) * rows]
        opt.zero_grad()
        if pipe is None:
            loss = loss_fn(model(x), y)
            loss.backward()
        else:
            loss = pipe.step(x, y)  # the step's mean loss on the last stage, None elsewhere
        norm = ctx.clip_grad_norm_(0.5)  # the whole model's norm, whatever the layout
        opt.step()
        if pipe is None and step % 4 == 3:  # an evaluation forward before the save at this step's end
            with torch.no_grad():
                model(x)
        mean = (loss.detach() / dp) if (last and ctx.tp_rank == 0) else torch.zeros(())
        dist.all_reduce(mean)
        ctx.metrics.log(step=step, loss=float(mean), grad_norm=norm)
        ctx.checkpoint.step(step)
    (ctx.run_dir / f"state_bytes.{ctx.rank}").write_text(str(state_bytes(model, opt)))
    from torch.distributed._composable.contract import _get_registry

    wrapped = sum(1 for b in model.layers.children() if "checkpoint" in (_get_registry(b) or {}))
    (ctx.run_dir / f"ac_blocks.{ctx.rank}").write_text(str(wrapped))  # blocks under activation checkpointing

"""A user entry point (`train.entry: tp_grads_entry:main`) for hpcscale.parallel.tp_grads, at any tp x dp_shard x pp.

It trains two small attention models one after the other, each with its own AdamW, through ctx.parallelize with a
Megatron plan (q, k, v column-parallel: each tp rank holds whole heads; o row-parallel):
1. without a per-head norm: every parameter tp leaves whole (the pre-attention norm, the final norm, the head) is
   applied to the whole hidden state, so its gradient is the same on every tp rank; the rank writes
   RUN/good.<rank>.json with the step losses once it has trained;
2. with Qwen3's per-head q_norm and k_norm (RMSNorm over head_dim, shared by the heads), left out of the plan:
   each tp rank applies them to its own heads only. It is registered with ctx.checkpoint.restore first, as the
   documented loop does (a fresh start's restore makes an optimizer step at learning rate 0, which must not use
   the check up). hpcscale must refuse it at its first optimizer step; if it does not, the rank writes
   RUN/bad.<rank>.json and the job ends 0.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

BATCH, SEQ, DIM, HEADS, LAYERS, STEPS = 4, 6, 16, 4, 2, 3


class Attention(nn.Module):
    def __init__(self, *, qk_norm: bool):
        super().__init__()
        self.head_dim = DIM // HEADS  # tp_check: each tp rank must hold whole heads
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else None

    def forward(self, x):  # (B, T, D)
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim) for f in (self.q, self.k, self.v))  # (B, T, heads here, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, *, qk_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = Attention(qk_norm=qk_norm)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Model(nn.Module):
    def __init__(self, *, qk_norm: bool):
        super().__init__()
        self.layers = nn.ModuleList(Block(qk_norm=qk_norm) for _ in range(LAYERS))
        self.out_norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        if self.head is not None:  # the last pipeline stage's
            x = self.head(self.out_norm(x))
        return x


def batch(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=g), torch.randn(BATCH, SEQ, DIM, generator=g)


def train(ctx, *, qk_norm: bool, restore: bool = False) -> list[float]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hpcscale.parallel.pipeline import cut_stage

    dims = ctx.dims
    torch.manual_seed(0)
    model = Model(qk_norm=qk_norm)
    if dims.pp > 1:
        cut_stage(model, stage=ctx.pp_rank, pp=dims.pp, first_stage_only=(), last_stage_only=("out_norm", "head"))
    plan = {}
    for i in model.layers._modules:
        plan |= {f"layers.{i}.attn.{n}": ColwiseParallel() for n in "qkv"}
        plan[f"layers.{i}.attn.o"] = RowwiseParallel()
    model = ctx.parallelize(model, tp_plan=plan, blocks=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if restore:  # as the documented loop does: a fresh start's restore makes torch's lr-0 step, which is no step
        ctx.checkpoint.restore(model, opt)
    pipe = ctx.pipeline(model, n_microbatches=2, loss_fn=F.mse_loss) if dims.pp > 1 else None
    share = BATCH // dims.dp
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[ctx.dp_rank * share : (ctx.dp_rank + 1) * share], y[ctx.dp_rank * share : (ctx.dp_rank + 1) * share]
        opt.zero_grad()
        if pipe is not None:
            loss = pipe.step(x, y)
        else:
            loss = F.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        mean = loss.detach() / (dims.dp * dims.tp) if loss is not None else torch.zeros(())
        dist.all_reduce(mean)
        losses.append(float(mean))
    return losses


def main(ctx) -> None:
    good = train(ctx, qk_norm=False)
    Path(ctx.run_dir, f"good.{ctx.rank}.json").write_text(json.dumps(good))
    bad = train(ctx, qk_norm=True, restore=True)
    Path(ctx.run_dir, f"bad.{ctx.rank}.json").write_text(json.dumps(bad))

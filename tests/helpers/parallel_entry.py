"""A user entry point (`train.entry: parallel_entry:main`) that checks ctx.parallelize from the inside.

Every rank also trains an unparallelized copy of the same model on the whole global batch, alone: the
reference the parallel model must follow. It writes RUN/rank<R>.json with:
- replicas_equal_after_parallelize: each rank seeded differently before building, equal weights after
  (parallelize broadcasts from the dp group's first rank, as DDP does);
- max_diff_vs_reference: parallel model (dp, and tp when the job has tp > 1) against the reference, after
  a few AdamW steps;
- max_diff_accumulated_vs_whole: two micro-batches, the first inside ctx.no_sync(), against one backward;
- max_diff_vs_ddp (tp = 1): against torch's DistributedDataParallel on the same batches;
- dtensor_params: how many parameters tp turned into DTensors.
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

STEPS, BATCH, DIM = 4, 8, 16


def build(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def params_of(model):
    return {n: full(p.detach()) for n, p in model.named_parameters()}


def max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def train(model, ctx, *, micro=1, ddp=False):
    """STEPS AdamW steps on this dp rank's share of each global batch (all of it when dp is not used)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    dp, r = (ctx.dims.dp, ctx.dp_rank) if ctx is not None else (1, 0)
    for step in range(STEPS):
        x, y = batch(step)
        part = BATCH // dp
        x, y = x[r * part : (r + 1) * part], y[r * part : (r + 1) * part]
        opt.zero_grad()
        xs, ys = x.chunk(micro), y.chunk(micro)
        for i in range(micro):
            last = i == micro - 1
            if ddp and not last:
                with model.no_sync():
                    (nn.functional.mse_loss(model(xs[i]), ys[i]) / micro).backward()
            elif ctx is not None and not last:
                with ctx.no_sync():
                    (nn.functional.mse_loss(model(xs[i]), ys[i]) / micro).backward()
            else:
                (nn.functional.mse_loss(model(xs[i]), ys[i]) / micro).backward()
        opt.step()
    return model


def main(ctx):
    out = {"rank": ctx.rank}

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()} if ctx.dims.tp > 1 else None
    model = build(0 if ctx.dims.tp > 1 else 1 + ctx.rank)  # tp shards must start from the same full weights
    model = ctx.parallelize(model, tp_plan=plan)
    start = params_of(model)
    mine = torch.cat([t.reshape(-1) for t in start.values()])
    first = mine.clone()
    dist.broadcast(first, src=0)
    out["replicas_equal_after_parallelize"] = bool(torch.equal(mine, first))
    out["dtensor_params"] = sum(hasattr(p, "to_local") for p in model.parameters())
    # the reference starts where parallelize left the weights (rank 0's seed, broadcast)
    ref_model = build(0)
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            p.copy_(start[n])
    reference = params_of(train(ref_model, None))
    out["max_diff_vs_reference"] = max_diff(params_of(train(model, ctx)), reference)

    accumulated = ctx.parallelize(build(0), tp_plan=dict(plan) if plan else None)
    whole = ctx.parallelize(build(0), tp_plan=dict(plan) if plan else None)
    out["max_diff_accumulated_vs_whole"] = max_diff(
        params_of(train(accumulated, ctx, micro=2)), params_of(train(whole, ctx))
    )
    if ctx.dims.tp == 1:
        ddp = nn.parallel.DistributedDataParallel(build(0), process_group=ctx.mesh["dp"].get_group())
        ours = ctx.parallelize(build(0))
        out["max_diff_vs_ddp"] = max_diff(
            params_of(train(ddp, _DpOnly(ctx), micro=2, ddp=True).module), params_of(train(ours, ctx, micro=2))
        )
    (ctx.run_dir / f"rank{ctx.rank}.json").write_text(json.dumps(out))


class _DpOnly:
    """ctx's dp coordinates for the DDP run, which accumulates through the model's own no_sync."""

    def __init__(self, ctx):
        self.dims, self.dp_rank = ctx.dims, ctx.dp_rank

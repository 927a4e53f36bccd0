"""A user entry point whose FLOPs are known by hand (tests/training/test_efficiency.py).

A two-layer MLP without biases, 16 -> 64 -> 16, on `batch` samples per rank, trained with foreach AdamW
(torch's default on CUDA) at the job's data parallelism; `tokens_per_step` = samples per global step. Each
rank's step: the two forward products, the second layer's input and weight gradients, the first layer's weight
gradient only (its input needs none): 5 x 2 x batch x 16 x 64 FLOPs. An evaluation inside
ctx.checkpoint.paused in the counted step must count nothing.
"""

import torch

D_IN, HIDDEN = 16, 64


def main(ctx):
    batch = ctx.params["batch"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN, bias=False), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, D_IN, bias=False)
    )
    ctx.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ctx.checkpoint.steps = ctx.params["steps"]
    ctx.checkpoint.tokens_per_step = batch * ctx.world_size
    start = ctx.checkpoint.restore(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    for step in range(start, ctx.params["steps"]):
        x = torch.randn(batch, D_IN, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        if step == start + 1:  # inside the counted step: left out
            with ctx.checkpoint.paused("evaluation"), torch.no_grad():
                model(torch.randn(1000, D_IN, generator=g))
        ctx.metrics.log(step=step, loss=loss.detach())
        ctx.checkpoint.step(step)

"""A user entry point with the documented `ctx.checkpoint.rebuild` hook (tests/training/test_context_runtime.py).

Trains `steps` steps of a small MLP at the job's data parallelism, saving on the job's period. When every
checkpoint is refused after part of it was read into the model, `restore` calls rebuild, which builds and
parallelizes a fresh model; the entry then records whether anything still holds the first model (a weak
reference after gc), what ctx.models holds, and the gradient norm clip_grad_norm_ measures next to the norm of
the fresh model's own gradients.
"""

import gc
import json
import weakref

import torch
import torch.distributed as dist


def build(ctx):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ctx.parallelize(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def main(ctx):
    model, opt = build(ctx)
    first = weakref.ref(model)
    built = []

    def rebuild():
        nonlocal model, opt
        model, opt = build(ctx)
        built.append(True)
        return model, opt

    ctx.checkpoint.rebuild = rebuild
    ctx.checkpoint.steps = ctx.params["steps"]
    start = ctx.checkpoint.restore(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    out = {}
    for step in range(start, ctx.params["steps"]):
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        norm = float(ctx.clip_grad_norm_(0.0))  # 0: measure only
        own = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        out.setdefault("norms", []).append([norm, own])
        opt.step()
        ctx.checkpoint.step(step)
    if built:
        gc.collect()
        out["rebuilt"] = True
        out["first_model_alive"] = first() is not None
        out["models_are_the_new_one"] = [m is model for m in ctx.models]
    dist.barrier()
    (ctx.run_dir / f"rebuild{ctx.rank}.json").write_text(json.dumps(out))

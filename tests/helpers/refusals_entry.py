"""A user entry point that makes every documented bad call of the Context API (docs/context-api.md, "Errors")
and records what each raised: `RUN/refusals.RANK.json`, call -> "ExceptionType: message". With
train.params.uncaught set, it makes that one call without catching it (the job must end with exit 2)."""

from __future__ import annotations

import json

import torch

from hpcscale.errors import BadInput
from hpcscale.parallel.pipeline import cut_stage


def _net() -> torch.nn.Module:
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return x

    return Net()


def main(ctx):
    got: dict[str, str] = {}
    model = _net()

    def attempt(name: str, call) -> None:
        if ctx.params.get("uncaught") == name:
            call()
        try:
            call()
            got[name] = "accepted"
        except BadInput as e:
            got[name] = f"BadInput: {e}"
        except Exception as e:  # a refusal that is not BadInput would end the job with exit 1: recorded as such
            got[name] = f"{type(e).__name__}: {e}"

    pp = ctx.dims.pp
    attempt("cut_stage stage", lambda: cut_stage(_net(), stage=pp, pp=pp, first_stage_only=(), last_stage_only=()))
    attempt("cut_stage layers", lambda: cut_stage(_net(), stage=0, pp=pp, first_stage_only=(), last_stage_only=(),
                                                  layers="blocks"))  # fmt: skip
    cut_stage(model, stage=ctx.pp_rank, pp=pp, first_stage_only=(), last_stage_only=())
    attempt("parallelize mixed_precision", lambda: ctx.parallelize(model, mixed_precision="fp8"))
    attempt("parallelize init", lambda: ctx.parallelize(model, init=lambda m: None))
    attempt("pipeline before parallelize", lambda: ctx.pipeline(model, n_microbatches=2, loss_fn=None))
    ctx.parallelize(model)
    attempt("parallelize twice", lambda: ctx.parallelize(model))
    attempt("pipeline schedule", lambda: ctx.pipeline(model, n_microbatches=2, loss_fn=None, schedule="zb"))
    attempt("pipeline n_microbatches", lambda: ctx.pipeline(model, n_microbatches=0, loss_fn=None))
    attempt("pipeline 1f1b", lambda: ctx.pipeline(model, n_microbatches=1, loss_fn=None))
    attempt("clip_grad_norm_ max_norm", lambda: ctx.clip_grad_norm_(-1.0))
    attempt("metrics.log tensor", lambda: ctx.metrics.log(step=0, loss=torch.ones(3)))
    attempt("checkpoint.step before restore", lambda: ctx.checkpoint.step(0))
    attempt("checkpoint.save before restore", lambda: ctx.checkpoint.save(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attempt("checkpoint.restore optimizer without model", lambda: ctx.checkpoint.restore(None, opt))
    attempt("checkpoint.restore object without state_dict", lambda: ctx.checkpoint.restore(model, opt, x=object()))
    ctx.checkpoint.restore(model, opt)
    attempt("checkpoint.restore twice", lambda: ctx.checkpoint.restore(model, opt))
    (ctx.run_dir / f"refusals.{ctx.rank}.json").write_text(json.dumps(got, indent=1))

"""A user's language model whose output head is tied to its embedding (`train.entry: tied_entry:main`), as Llama
3.2, Qwen2.5, GPT-2 and Gemma are by default, at whatever layout the job gives: built on the meta device or
whole (`train.params.meta`), cut into pipeline stages, split by a tensor-parallel plan that splits the embedding
by rows and the head by columns, sharded by FSDP2. Trained with foreach AdamW (torch's default on GPUs) and
`ctx.clip_grad_norm_`. Beside it, on every rank, the same model built whole, initialized by
hpcscale.parallel.init.initialize and trained in one process on the same global batches with torch's own clip.
RUN/tied.RANK.json: both runs' losses and norms, and the tie as this rank sees it.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, SEQ, BATCH, LAYERS = 32, 16, 8, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(F.gelu(self.fc(h)))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x  # a pipeline stage without the embedding gets activations
        for block in self.layers:
            h = block(h)
        return self.head(self.norm(h)) if self.head is not None else h


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (x * 3 + 1) % VOCAB


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def reference(steps: int) -> tuple[list[float], list[float]]:
    from hpcscale.parallel.init import initialize

    whole = TiedLM()
    initialize(whole, None, seed=0)
    opt = torch.optim.AdamW(whole.parameters(), lr=1e-2, foreach=False)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(whole(x), y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(whole.parameters(), 1.0)))
        opt.step()
        losses.append(float(loss))
    return losses, norms


def digest(t: torch.Tensor) -> str:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return hashlib.sha256(full.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def main(ctx) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from hpcscale.parallel.init import initialize
    from hpcscale.parallel.pipeline import cut_stage

    p, dims = ctx.params, ctx.dims
    steps = int(p.get("steps", 6))
    if p.get("meta"):
        with torch.device("meta"):
            model = TiedLM()
    else:
        model = TiedLM()
        initialize(model, None, seed=0)
    if dims.pp > 1:
        cut_stage(model, stage=ctx.pp_rank, pp=dims.pp, first_stage_only=("emb",), last_stage_only=("norm", "head"))
    plan = None
    if dims.tp > 1:
        plan = {f"layers.{i}.fc": ColwiseParallel() for i, _ in model.layers.named_children()}
        plan |= {f"layers.{i}.proj": RowwiseParallel() for i, _ in model.layers.named_children()}
        if model.emb is not None and not p.get("split_head_only"):
            plan["emb"] = RowwiseParallel(input_layouts=Replicate())
        if model.head is not None:
            plan["head"] = ColwiseParallel(output_layouts=Replicate())
    model = ctx.parallelize(model, tp_plan=plan, blocks=Block, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    pipe = ctx.pipeline(model, n_microbatches=2, loss_fn=loss_fn) if dims.pp > 1 else None
    share = BATCH // dims.dp
    losses, norms = {}, {}
    start = 0
    if p.get("ckpt"):  # saved and resumed by ctx.checkpoint (a later run may resume at another layout)
        ctx.checkpoint.steps = steps
        start = ctx.checkpoint.restore(model, opt)
    for step in range(start, steps):
        x, y = batch(step)
        x, y = x[ctx.dp_rank * share : (ctx.dp_rank + 1) * share], y[ctx.dp_rank * share : (ctx.dp_rank + 1) * share]
        opt.zero_grad()
        if pipe is not None:
            loss = pipe.step(x, y)
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
        norm = ctx.clip_grad_norm_(1.0)
        opt.step()
        mean = loss.detach() / (dims.dp * dims.tp) if loss is not None else torch.zeros(())
        dist.all_reduce(mean)
        losses[step] = float(mean)
        norms[step] = float(norm)
        if p.get("ckpt"):
            ctx.checkpoint.step(step)
    names = dict(model.named_parameters(remove_duplicate=False))
    copies = {n: digest(t) for n, t in names.items() if n in ("emb.weight", "head.weight")}
    report = {
        "losses": losses,
        "norms": norms,
        "one_parameter": (
            "emb.weight" in names and "head.weight" in names and names["emb.weight"] is names["head.weight"]
        ),
        "copies": copies,  # full-tensor digests of this rank's copies of the tied weight
        "stage": ctx.pp_rank,
        "parameters": len(list(model.parameters())),
    }
    if ctx.rank == 0:
        report["reference"], report["reference_norms"] = reference(steps)
    (ctx.run_dir / f"tied.{ctx.rank}.json").write_text(json.dumps(report))

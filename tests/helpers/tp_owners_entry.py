"""A user's model that a tensor-parallel plan covers only in part (`train.entry: tp_owners_entry:main`, tp = 2):
a root that owns a parameter and adds it to its children's output, a module with running-statistics buffers,
tensors made inside forward, and an embedding tied to the head. Trained with foreach AdamW (torch's default on
GPUs), which refuses a parameter group that mixes plain tensors and DTensors. Beside it, on every rank, the same
model built whole and trained with the same data without tensor parallelism. RUN/tp_owners.RANK.json: both
runs' losses, whether every parameter is a DTensor, and whether the embedding and the head still share one.
"""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, SEQ, BATCH, STEPS = 32, 16, 8, 4, 4


class Mix(nn.Module):
    """Owns a parameter and has children: its forward mixes its own tensor with what the children return."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)  # running statistics: buffers beside its parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(F.gelu(self.fc(x))) * self.gain
        scale = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype).reciprocal()  # made in forward
        h = h + scale[None, :, None]
        return x + self.norm(h.transpose(1, 2)).transpose(1, 2)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))  # the root's own, used with its children's outputs
        self.mix = Mix()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.emb(x) + self.pos))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (x + 1) % VOCAB


def train(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


def main(ctx) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    whole = Net()
    torch.manual_seed(0)
    model = Net()
    plan = {"mix.fc": ColwiseParallel(), "mix.proj": RowwiseParallel()}
    model = ctx.parallelize(model, tp_plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = train(model, opt)
    reference = train(whole, torch.optim.AdamW(whole.parameters(), lr=1e-2, foreach=False))
    report = {
        "losses": losses,
        "reference": reference,
        "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "tied": model.head.weight is model.emb.weight,
        "params": sorted(n for n, _ in model.named_parameters()),
    }
    (ctx.run_dir / f"tp_owners.{ctx.rank}.json").write_text(json.dumps(report))

"""A small GPT (Radford et al. 2019; layout after nanoGPT), written so tp and pp can cut it cleanly.

- q, k and v are separate Linear layers: column-parallel splits each by heads, so a tp rank owns whole heads.
- layers live in a ModuleDict keyed by their global index ("0", "1", ...): a pipeline stage deletes the ones
  it does not own and keeps the names, so checkpoints line up across layouts.
- tok_emb/pos_emb exist only on the first stage, norm/output only on the last (None elsewhere).
- no dropout and no weight tying: every layout must compute the same losses.
- initialization is seeded per module by name (hpcscale.parallel.init): built whole here, or on the meta device
  and materialized shard by shard by ctx.parallelize, every layout starts from bitwise the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpcscale.parallel.init import initialize


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTShape:
    vocab_size: int
    seq_len: int
    n_layer: int
    n_embd: int
    n_head: int


class Attention(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.head_dim = s.n_embd // s.n_head
        self.q = nn.Linear(s.n_embd, s.n_embd, bias=False)
        self.k = nn.Linear(s.n_embd, s.n_embd, bias=False)
        self.v = nn.Linear(s.n_embd, s.n_embd, bias=False)
        self.o = nn.Linear(s.n_embd, s.n_embd, bias=False)
        self.o.residual_out = True  # GPT-2's scaled init (GPT.init_module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C)
        # Under tensor parallelism q/k/v return this rank's heads only: (B, T, C/tp).
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh_local, T, hs)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.fc = nn.Linear(s.n_embd, 4 * s.n_embd)
        self.proj = nn.Linear(4 * s.n_embd, s.n_embd)
        self.proj.residual_out = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.n_embd)
        self.attn = Attention(s)
        self.ln_2 = nn.LayerNorm(s.n_embd)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # What a pipeline cut (hpcscale.parallel.pipeline.cut_stage) keeps only on the first and the last stage.
    FIRST_STAGE_ONLY = ("tok_emb", "pos_emb")
    LAST_STAGE_ONLY = ("norm", "output")

    def __init__(self, s: GPTShape, *, seed: int = 0):
        """Built under torch.device("meta") the model has no storage and is left uninitialized: ctx.parallelize(
        model, init=model.init_module, seed=seed) materializes it. Anywhere else it is initialized here."""
        super().__init__()
        self.shape = s
        self.tok_emb: nn.Embedding | None = nn.Embedding(s.vocab_size, s.n_embd)
        self.pos_emb: nn.Embedding | None = nn.Embedding(s.seq_len, s.n_embd)
        self.layers = nn.ModuleDict({str(i): Block(s) for i in range(s.n_layer)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(s.n_embd)
        self.output: nn.Linear | None = nn.Linear(s.n_embd, s.vocab_size, bias=False)
        if not self.tok_emb.weight.is_meta:
            initialize(self, self.init_module, seed=seed)

    def init_module(self, m: nn.Module) -> None:
        """One module's own weights: N(0, 0.02) for linear and embedding weights, zero biases, and GPT-2's
        N(0, 0.02 / sqrt(2 n_layer)) for the projections that write into the residual stream."""
        if isinstance(m, nn.Linear | nn.Embedding):
            std = 0.02 / math.sqrt(2 * self.shape.n_layer) if getattr(m, "residual_out", False) else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def tp_plan(self) -> dict:
        """Tensor parallelism for this model's blocks (those a pipeline cut kept), as torch's DTensor plans
        (Megatron-style, Shoeybi et al. 2019): q, k, v and mlp.fc column-parallel (each tp rank computes its
        heads, its slice of the hidden units), attn.o and mlp.proj row-parallel (partial sums all-reduced back
        to a replicated output): one all-reduce per sub-layer in forward and one in backward. Embeddings, norms
        and the output head stay replicated: at this model's vocabulary (256 bytes) sharding them would cost
        more than it saves."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        per_block = {"attn.q": ColwiseParallel, "attn.k": ColwiseParallel, "attn.v": ColwiseParallel}
        per_block |= {"attn.o": RowwiseParallel, "mlp.fc": ColwiseParallel, "mlp.proj": RowwiseParallel}
        return {f"layers.{i}.{name}": style() for i in self.layers for name, style in per_block.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, C) elsewhere; logits (B, T, V) at the end."""
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)  # (B, T, C)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.output(self.norm(x))  # (B, T, V)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

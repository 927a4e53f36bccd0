"""A tensor-parallel plan that does not fit the model is refused at start (exit 2, naming the module, the
parameter's dim and size, the tp axis and its degree), not inside torch at the first forward: real ranks on
gloo running a user's entry point, and the rule itself on models built on the meta device."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import yaml
from conftest import run_cli
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from hpcscale.parallel.tp_check import problems

ENTRY = textwrap.dedent(
    '''
    """Builds the model `params.model` names, parallelizes it with its plan, and runs one step; RUN/started.R
    is written after ctx.parallelize returns, RUN/stepped.R after the step."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


    class Mlp(nn.Module):
        def __init__(self, rows, vocab=16, dim=8):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(dim, rows), nn.ReLU(), nn.Linear(rows, dim))])

        def forward(self, x):
            x = self.emb(x)
            for block in self.layers:
                x = block(x)
            return x


    def build(p):
        if p["model"] == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
            model = LlamaForCausalLM(cfg)
            names = {"q_proj": "col", "k_proj": "col", "v_proj": "col", "o_proj": "row"}
            plan = {f"model.layers.*.self_attn.{n}": ColwiseParallel() if s == "col" else RowwiseParallel()
                    for n, s in names.items()}
            return model, plan, lambda m: m(torch.randint(0, 64, (2, 5))).logits
        model = Mlp(p["rows"], vocab=p.get("vocab", 16))
        plan = {"layers.*.0": ColwiseParallel(), "layers.*.2": RowwiseParallel()}
        if p.get("vocab"):  # an uneven vocabulary split by rows: the output is reduced, nothing to line up
            plan["emb"] = RowwiseParallel(input_layouts=Replicate())
        return model, plan, lambda m: m(torch.randint(0, p.get("vocab", 16), (2, 5)))


    def main(ctx):
        torch.manual_seed(0)
        model, plan, forward = build(ctx.params)
        model = ctx.parallelize(model, tp_plan=plan)
        (ctx.run_dir / f"started.{ctx.rank}").write_text("")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        forward(model).float().pow(2).mean().backward()
        opt.step()
        (ctx.run_dir / f"stepped.{ctx.rank}").write_text("")
    '''
)


def _run(tmp_path, name: str, *, tp: int, dp_shard: int = 1, ranks: int = 4, **params):
    (tmp_path / "layout_entry.py").write_text(ENTRY)
    spec = {
        "name": name,
        "site": "local",
        "tasks_per_node": ranks,
        "parallel": {"tp": tp, **({"dp_shard": dp_shard} if dp_shard > 1 else {})},
        "environment": {"PYTHONPATH": str(tmp_path)},
        "train": {"entry": "layout_entry:main", "params": params},
    }
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / name
    r = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=300)
    return r, run


def test_an_uneven_column_parallel_split_under_fsdp_is_refused_before_any_step(mpi, tmp_path):
    """tp 2 x dp_shard 2, a column-parallel Linear of 5 output rows (and its row-parallel partner of 5 input
    columns): exit 2 naming both weights, their dims and sizes, the tp axis and degree 2; no rank got past
    ctx.parallelize (was: accepted, then 'a and b must have same reduction dim' inside the first forward)."""
    r, run = _run(tmp_path, "uneven", tp=2, dp_shard=2, model="mlp", rows=5)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "layers.0.0.weight: ColwiseParallel splits dim 0 (size 5) over the tp axis (degree 2)" in out, out[-3000:]
    assert "layers.0.2.weight: RowwiseParallel splits dim 1 (size 5) over the tp axis (degree 2)" in out
    assert not list(run.glob("started.*"))


def test_kv_heads_that_tp_would_cut_are_refused_naming_the_projection(mpi, tmp_path):
    """A transformers Llama with 2 key-value heads at tp 4: k_proj's 32 rows divide by 4, but each rank would
    hold half a head; refused at start naming k_proj and v_proj (was: a view error inside attention)."""
    pytest.importorskip("transformers")
    r, run = _run(tmp_path, "kvheads", tp=4, model="llama")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    for proj in ("k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{proj}.weight: ColwiseParallel splits dim 0 (size 32)" in out, out[-3000:]
    assert "2 heads of head_dim 16" in out and "q_proj" not in out
    assert not list(run.glob("started.*"))


def test_a_plan_that_fits_trains_including_the_splits_torch_handles_unevenly(mpi, tmp_path):
    """Rows that tp divides, FSDP2 splitting a 3-row slice over 2 ranks, and a 15-token vocabulary split by
    rows (its output is reduced from partial sums): accepted, and every rank takes its step."""
    r, run = _run(tmp_path, "fits", tp=2, dp_shard=2, model="mlp", rows=6, vocab=15)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert len(list(run.glob("stepped.*"))) == 4


# -- the rule on models built on the meta device (no ranks: it reads shapes only) ------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)


PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.o": RowwiseParallel()}


@pytest.mark.parametrize(
    "dim, heads, kv_heads, tp, refused",
    [
        (64, 8, 8, 4, set()),
        (64, 8, 2, 4, {"attn.k"}),  # 2 kv heads over 4 ranks
        (48, 3, 3, 2, {"attn.q", "attn.k"}),  # 3 heads of 16: 48 divides by 2, the heads do not
        (10, 2, 2, 4, {"attn.q", "attn.k", "attn.o"}),  # 10 rows over 4
        (64, 8, 2, 2, set()),
    ],
)
def test_heads_and_sizes_are_checked_where_the_plan_splits_them(dim, heads, kv_heads, tp, refused):
    with torch.device("meta"):
        model = nn.Module()
        model.attn = Attention(dim, heads, kv_heads)
    assert {p.module for p in problems(model, PLAN, tp=tp)} == refused


def test_splits_torch_handles_unevenly_are_left_alone():
    """A row-parallel embedding (uneven vocabulary), a column-parallel layer gathered or kept as a DTensor, a
    row-parallel layer fed a replicated input, and styles that split no parameter."""
    with torch.device("meta"):
        model = nn.Module()
        model.emb = nn.Embedding(15, 8)
        model.gathered = nn.Linear(8, 5)
        model.dtensor = nn.Linear(8, 5)
        model.replicated_in = nn.Linear(5, 8)
        model.norm = nn.LayerNorm(5)
        model.col_emb = nn.Embedding(16, 5)
    plan = {
        "emb": RowwiseParallel(input_layouts=Replicate()),
        "gathered": ColwiseParallel(output_layouts=Replicate()),
        "dtensor": ColwiseParallel(use_local_output=False),
        "replicated_in": RowwiseParallel(input_layouts=Replicate()),
        "norm": SequenceParallel(),
    }
    assert problems(model, plan, tp=2) == []
    (found,) = problems(model, {**plan, "col_emb": ColwiseParallel()}, tp=2)
    assert (found.module, found.dim, found.size) == ("col_emb", 1, 5)  # an embedding's columns, handed on local
    assert json.dumps(found.line(2)).count("tp axis (degree 2)") == 1

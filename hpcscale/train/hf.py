"""A Hugging Face transformers causal LM parallelized in one call: `lm = hf.parallelize(ctx, model, ...)`.

What ctx.parallelize and ctx.pipeline need to know of a model family is a handful of parts (an `Adapter`), written
once here for the families docs/huggingface.md names and passed by hand for any other:

- `layers`: the decoder stack, a dotted path (`model.layers`). Its entries are the FSDP2 units
  (ctx.parallelize's `blocks=`) and what cut_stage splits over the pipeline stages;
- `first_stage_only` / `last_stage_only`: the embeddings, and the final norm and the head, kept on the first and
  the last pipeline stage;
- `tp_plan(model)`: the tensor-parallel plan of the modules this stage holds, Megatron-style (Shoeybi et al.
  2019): q, k, v, gate and up split by output features, so each tp rank owns whole heads and a slice of the MLP;
  o and down by input features, their partial sums all-reduced. The embedding is split by vocabulary rows
  (RowwiseParallel: each rank looks up the rows it holds, the others add zeros) and the head by output rows
  (ColwiseParallel, its logits gathered whole): both split the [vocab, hidden] weight on dim 0, which is what a
  tied embedding and head need to stay one parameter (hpcscale.parallel.ties: split alike or not at all), and
  gathered logits keep the loss the plain cross-entropy of the whole model. Every other parameter must be one the
  plan knows to be safe whole on every tp rank (the norms of the whole hidden state); any other is refused, since
  left replicated inside a tp-split attention (Qwen3's per-head q_norm) it would get one rank's part of its
  gradient. GPT-2's plan refuses tp outright: its q, k and v are one fused Conv1D;
- `stage_forward(model, inputs)`: one pipeline stage's forward: token ids (first stage) or the hidden states the
  stage before sent in, hidden states or logits (last stage) out, with the whole model's arithmetic: the rotary
  embeddings built on every stage, and each layer's attention mask what transformers' own mask functions give
  the whole model's forward on a batch without padding (None under sdpa, which is then causal by itself; a
  sliding window where the config has one). The model's own forward would embed tokens on every stage.

`ParallelLM` is what `parallelize` returns: the rank's part of the model (for the optimizer and ctx.checkpoint),
its pipeline schedule or None, and `step`, `evaluate` and `mean_loss`, the three calls whose form depends on the
layout. Everything else (the optimizer, the data, the checkpoints, the loop) stays the entry point's own.

Imported by entry points only (it imports transformers); the CLI never imports it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hpcscale.errors import BadInput
from hpcscale.parallel.pipeline import cut_stage

# the public API (docs/context-api.md, docs/huggingface.md, docs/checkpoint-format.md): what user code imports
__all__ = ["ADAPTERS", "GPT2", "LLAMA", "Adapter", "ParallelLM", "adapter_for", "lm_loss", "parallelize", "stage_plan"]

try:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
except ImportError as e:  # an optional dependency: say which extra brings it
    raise ImportError(f"hpcscale.train.hf needs transformers: pip install 'hpcscale[hf]' ({e})") from None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over every position: logits [batch, seq, vocab] (fp32 for the
    softmax), targets [batch, seq], already shifted (ctx.token_batches' targets are the inputs one token on)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@dataclass(frozen=True, kw_only=True, slots=True)
class Adapter:
    """The parts of one transformers model family that ctx.parallelize and ctx.pipeline need."""

    name: str
    """The family, for messages ("Llama")."""
    layers: str
    """Dotted path of the decoder layers (a ModuleList): the FSDP2 units and what the pipeline stages split."""
    first_stage_only: tuple[str, ...]
    """Dotted paths of the modules only the first pipeline stage keeps (the embeddings)."""
    last_stage_only: tuple[str, ...]
    """Dotted paths of the modules only the last pipeline stage keeps (the final norm, the head)."""
    tp_plan: Callable[[nn.Module], dict[str, Any]]
    """The tensor-parallel plan of a stage (or the whole model) from its modules; BadInput where the family
    has none."""
    stage_forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """A pipeline stage's forward, bound as the cut model's `forward` at parallel.pp > 1."""


def _named(name: str, pattern: str) -> bool:
    """Whether dotted module `name` is `pattern` (`*` standing for one dotted part, as in torch's plans)."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch(p, a) for p, a in zip(parts, atoms, strict=True))


def stage_plan(
    model: nn.Module, *, split: Mapping[str, Callable[[], Any]], whole: Sequence[str], adapter: str
) -> dict[str, Any]:
    """The tensor-parallel plan of the modules `model` holds (a pipeline stage's, or the whole model's).

    `split`: module names (`*` for one dotted part: a layer index) with a function making each one's
    ParallelStyle; names this stage does not hold (a dropped embedding, another stage's layers) are left out, and
    each module gets its own style object (torch's styles keep per-module state). `whole`: the modules whose
    parameters tp may leave whole on every rank (replicated), because every rank computes them on the whole
    activation: the layer norms of the hidden state. Every other parameter is refused (BadInput naming it): a
    parameter the plan does not split and the rank computes on its own heads only (a norm inside the attention,
    as Qwen3's q_norm) would get this rank's part of its gradient, not the sum."""
    names = [n for n, _ in model.named_modules()]
    plan = {n: make() for pattern, make in split.items() for n in names if _named(n, pattern)}
    strays = []
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if not any(_named(owner, p) for p in (*split, *whole)):
            strays.append(name)
    if strays:
        listed = ", ".join(strays[:4]) + (f" and {len(strays) - 4} more" if len(strays) > 4 else "")
        raise BadInput(
            f"hf.parallelize: {type(model).__name__} has parameters the {adapter} adapter's tensor-parallel plan "
            f"neither splits nor knows to be safe whole ({listed}): a parameter each tp rank applies to its own "
            "heads only (a norm inside the attention) would get that rank's part of its gradient. Run with "
            "parallel.tp = 1, or pass adapter= with a tp_plan that splits them (or lists them as whole, if every "
            "tp rank applies them to the whole hidden state)"
        )
    return plan


# --- Llama and the families built like it: Mistral, Qwen2 ---------------------------------------------------


def _llama_tp_plan(model: nn.Module) -> dict[str, Any]:
    col, row = ColwiseParallel, RowwiseParallel
    return stage_plan(
        model,
        adapter="Llama",
        split={
            # the ids come whole to every tp rank; each looks up the vocabulary rows it holds, the sum is exact
            "model.embed_tokens": lambda: RowwiseParallel(input_layouts=Replicate()),
            "model.layers.*.self_attn.q_proj": col,
            "model.layers.*.self_attn.k_proj": col,
            "model.layers.*.self_attn.v_proj": col,
            "model.layers.*.self_attn.o_proj": row,
            "model.layers.*.mlp.gate_proj": col,
            "model.layers.*.mlp.up_proj": col,
            "model.layers.*.mlp.down_proj": row,
            # logits gathered whole: the loss is the plain cross-entropy, each logit computed on one rank
            "lm_head": lambda: ColwiseParallel(output_layouts=Replicate()),
        },
        # RMSNorms of the whole hidden state, before attention, before the MLP, at the end
        whole=("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"),
    )


def _layer_kind(config: Any, index: int) -> str:
    """The attention a layer has, as the whole model's forward picks its mask: Qwen2 (and newer) list it per
    layer in `layer_types`; Mistral slides over every layer when `sliding_window` is set; Llama never does."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return kinds[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _masks(config: Any, hidden: torch.Tensor, positions: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
    """Each kind of layer's mask for a batch without padding and no cache, from transformers' own functions (the
    model's forward calls the same): None where sdpa's is_causal serves, a tensor otherwise."""
    made = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    unknown = kinds - set(made)
    if unknown:
        raise BadInput(f"hf: layer_types {sorted(unknown)} have no stage forward here (known: {sorted(made)})")
    args = dict(config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions)
    return {kind: made[kind](**args) for kind in kinds}


def _llama_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's forward for one stage: ids [batch, seq] or hidden states [batch, seq, hidden] in, hidden
    states or logits [batch, seq, vocab] out."""
    m = self.model
    h = m.embed_tokens(x) if m.embed_tokens is not None else x  # (B, T, hidden)
    pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)  # (1, T): no cache, no padding
    layers = [(int(i), layer) for i, layer in m.layers.named_children()]  # global indices: the config's layer_types
    masks = _masks(self.config, h, pos, {_layer_kind(self.config, i) for i, _ in layers})
    rope = m.rotary_emb(h, pos)  # every stage builds the (cos, sin) the whole model shares among its layers
    for i, layer in layers:
        h = layer(h, attention_mask=masks[_layer_kind(self.config, i)], position_ids=pos, position_embeddings=rope)
    return self.lm_head(m.norm(h)) if self.lm_head is not None else h


LLAMA = Adapter(
    name="Llama",
    layers="model.layers",
    first_stage_only=("model.embed_tokens",),
    last_stage_only=("model.norm", "lm_head"),
    tp_plan=_llama_tp_plan,
    stage_forward=_llama_stage_forward,
)


# --- GPT-2 ------------------------------------------------------------------------------------------------------


def _gpt2_tp_plan(model: nn.Module) -> dict[str, Any]:
    first = next(iter(model.transformer.h._modules), "0")
    raise BadInput(
        f"hf.parallelize: {type(model).__name__} has no tensor-parallel plan: its attention's query, key and value "
        f"are one fused Conv1D (transformer.h.{first}.attn.c_attn, weight [hidden, 3 x hidden]), which a column "
        "split would cut across q, k and v rather than by heads, and torch's ColwiseParallel and RowwiseParallel "
        "take nn.Linear and nn.Embedding only; run it with parallel.tp = 1 (parallel.pp and parallel.dp_shard "
        "work), or pass adapter= with a tp_plan of your own for a model whose projections are separate Linears"
    )


def _gpt2_stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """GPT2LMHeadModel's forward for one stage: ids [batch, seq] or hidden states in, hidden states or logits out."""
    t = self.transformer
    pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T): no cache, no padding
    h = t.drop(t.wte(x) + t.wpe(pos)) if t.wte is not None else x  # (B, T, hidden)
    mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
    for layer in t.h:
        h = layer(h, None, mask, position_ids=pos)
    return self.lm_head(t.ln_f(h)) if self.lm_head is not None else h


GPT2 = Adapter(
    name="GPT-2",
    layers="transformer.h",
    first_stage_only=("transformer.wte", "transformer.wpe"),
    last_stage_only=("transformer.ln_f", "lm_head"),
    tp_plan=_gpt2_tp_plan,
    stage_forward=_gpt2_stage_forward,
)

# by class name, matched along the model's class hierarchy (a subclass of LlamaForCausalLM is a Llama): no
# transformers modeling module is imported to look one up
ADAPTERS: dict[str, Adapter] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,
    "GPT2LMHeadModel": GPT2,
}


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of `model`'s family (ADAPTERS, by the nearest class in its hierarchy); BadInput naming the class
    and the known ones otherwise."""
    for cls in type(model).__mro__:
        if cls.__name__ in ADAPTERS:
            return ADAPTERS[cls.__name__]
    raise BadInput(
        f"hf.parallelize: no adapter for {type(model).__name__} (known: {', '.join(sorted(ADAPTERS))}); a model "
        "built like Llama (model.layers of decoder layers taking position_embeddings, q/k/v/o_proj and "
        "gate/up/down_proj) runs with adapter=hf.LLAMA (whose tp plan refuses a parameter it does not know), any "
        "other with adapter=hf.Adapter(...) naming its parts (docs/huggingface.md)"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLM:
    """A causal LM parallelized on this rank: `model` is the rank's part of it (its pipeline stage when
    parallel.pp > 1; its tp and FSDP shards), what the optimizer and ctx.checkpoint take; `pipeline` runs its
    steps at pp > 1 (None at pp 1)."""

    ctx: Any
    model: nn.Module
    pipeline: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(default=lm_loss)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One batch's forward and backward (this rank's slice of the global batch), gradients averaged over the
        data-parallel ranks; the optimizer step is the caller's. Returns the batch's mean loss where this rank
        computes it (every rank at pp 1; the last stage, through `pipeline.step`'s micro-batches, at pp > 1) and
        None elsewhere."""
        if self.pipeline is not None:
            return self.pipeline.step(inputs, targets)
        loss = self.loss_fn(self.model(input_ids=inputs).logits, targets)
        loss.backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The batch's mean loss, forward only (a validation batch); None on a pipeline stage before the last."""
        if self.pipeline is not None:
            return self.pipeline.eval(inputs, targets)
        return self.loss_fn(self.model(input_ids=inputs).logits, targets)

    def mean_loss(self, loss: torch.Tensor | None) -> float:
        """The loss averaged over the data-parallel replicas, for rank 0 to log: the ranks computing a loss (the
        last stage's, every rank at pp 1) hold it, each tp rank the same value; the others pass None. A
        collective over every rank: call it at the same point in each."""
        ctx = self.ctx
        if loss is None:
            share = torch.zeros((), device=ctx.device)
        else:
            share = loss.detach().float() / (ctx.dims.dp * ctx.dims.tp)
        dist.all_reduce(share)
        return float(share)


def parallelize(
    ctx: Any,
    model: nn.Module,
    *,
    n_microbatches: int | None = None,
    adapter: Adapter | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
    schedule: str = "1f1b",
    split: Sequence[int] | None = None,
    init: Callable[[nn.Module], None] | None = None,
    seed: int = 0,
    mixed_precision: str | None = None,
) -> ParallelLM:
    """`model` (a transformers causal LM, built whole or on the meta device) made this rank's part of the job's
    layout, in place: with parallel.pp > 1 cut to this rank's stage (cut_stage, with `split` if given) and its
    forward replaced by the adapter's stage_forward; then ctx.parallelize with the adapter's tp plan (at
    parallel.tp > 1) and its decoder layers as the FSDP2 units (`init`, `seed` and `mixed_precision` passed
    through); then, at pp > 1, ctx.pipeline(`n_microbatches`, `loss_fn`, `schedule`). `adapter`: by default the
    one ADAPTERS names for the model's class; pass one for a family it does not know. `n_microbatches` is what
    each step's batch is split into at pp > 1 (at least pp with 1F1B); at pp 1 there is no schedule and it is
    not used."""
    if adapter is None:
        adapter = adapter_for(model)
    pp = ctx.dims.pp
    if pp > 1 and n_microbatches is None:
        raise BadInput(
            f"hf.parallelize: parallel.pp is {pp}: pass n_microbatches= (each step's batch is split into that many "
            f"micro-batches; at least {pp} with the 1f1b schedule)"
        )
    if ctx.dims.tp > 1:
        # the plan checked on the whole model first: a refusal is then every rank's alike, whatever stage it holds,
        # and comes before any collective
        adapter.tp_plan(model)
    if pp > 1:
        cut_stage(
            model,
            stage=ctx.pp_rank,
            pp=pp,
            layers=adapter.layers,
            first_stage_only=adapter.first_stage_only,
            last_stage_only=adapter.last_stage_only,
            split=split,
        )
        # an instance attribute: nn.Module.__call__ reaches it, FSDP2's class swap keeps it
        model.forward = types.MethodType(adapter.stage_forward, model)
    plan = adapter.tp_plan(model) if ctx.dims.tp > 1 else None
    # the decoder layers this stage holds, in forward order: FSDP2's units (a class would name the same modules)
    blocks = list(model.get_submodule(adapter.layers).children())
    model = ctx.parallelize(model, tp_plan=plan, blocks=blocks, init=init, seed=seed, mixed_precision=mixed_precision)
    pipe = None
    if pp > 1:
        pipe = ctx.pipeline(model, n_microbatches=n_microbatches, loss_fn=loss_fn, schedule=schedule)
    return ParallelLM(ctx=ctx, model=model, pipeline=pipe, loss_fn=loss_fn)

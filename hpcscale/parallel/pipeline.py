"""Pipeline parallelism for the reference GPT with torch.distributed.pipelining (GPipe or 1F1B).

The model is built whole on every rank (same seed, so identical), then each stage drops what it does not own:
layers are split into pp contiguous runs (earlier stages take the remainder), embeddings stay on the first
stage, the final norm and output head on the last. 1F1B: Narayanan et al., SC'21; GPipe: Huang et al. 2019.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from hpcscale.train.model import GPT

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def cut_stage(model: GPT, *, stage: int, pp: int) -> GPT:
    """Keep only this stage's part of `model` (in place)."""
    if pp == 1:
        return model
    keep = {str(i) for i in stage_layers(model.shape.n_layer, pp, stage)}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_emb = None
        model.pos_emb = None
    if stage < pp - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(
    stage_module: torch.nn.Module,
    *,
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    kind: str,
    loss_fn: Callable,
    device: torch.device,
):
    stage = PipelineStage(stage_module, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group())
    # scale_grads: gradients are the mean over micro-batches, as with plain accumulation at pp=1.
    return SCHEDULES[kind](stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)

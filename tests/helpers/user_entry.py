"""A user entry point (`train.entry: user_entry:main`) for tests: checks what the Context hands over."""

import json

import torch
import torch.distributed as dist


def main(ctx):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    dp_group = ctx.mesh["dp"].get_group()
    d = torch.tensor([1.0])
    dist.all_reduce(d, group=dp_group)
    ctx.metrics.log(step=0, rank_sum=t.item())
    (ctx.run_dir / f"rank{ctx.rank}.json").write_text(
        json.dumps(
            {
                "rank": ctx.rank,
                "world": ctx.world_size,
                "local_rank": ctx.local_rank,
                "node": ctx.node,
                "coords": [ctx.pp_rank, ctx.dp_rank, ctx.tp_rank],
                "dims": [ctx.dims.pp, ctx.dims.dp, ctx.dims.tp],
                "mesh_dims": list(ctx.mesh.mesh_dim_names),
                "rank_sum": t.item(),
                "dp_group_size": d.item(),
                "device": str(ctx.device),
                "backend": ctx.backend,
                "params": ctx.params,
                "stop": ctx.should_stop(),
            }
        )
    )

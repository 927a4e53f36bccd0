"""A user entry point (`train.entry: user_entry:main`) for tests: checks what the Context hands over."""

import json
import os

import torch
import torch.distributed as dist

from hpcscale.parallel.mesh import group_timeout_s

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")


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
                "env": {k: os.environ.get(k) for k in ENV},
                "group_timeouts": {
                    axis: group_timeout_s(ctx.mesh[axis].get_group(), "cpu") for axis in ctx.dims.mesh_axes
                },
                "ckpt_group_timeout": group_timeout_s(ctx.checkpoint.manager.group, "cpu"),
            }
        )
    )

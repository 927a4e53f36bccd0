"""The (pp, dp, tp) DeviceMesh, its process groups built with the job's collective timeout.

torch's init_device_mesh makes each mesh dimension's groups with `new_group` (or `split_group` once NCCL is
eagerly initialised), and without options those get the backend's default timeout: 10 minutes for NCCL, 30 for
gloo, whatever `timeout_seconds` the job set for the default group. A hung tp or pp peer would then hold the
job far past the timeout its owner chose. Each dimension is given the backend's options with the job's timeout
(`backend_override`, which init_device_mesh passes to both ways of making the groups).

With sharded data parallelism (dp_shard > 1) the dp dimension is built as two, dp_replicate × dp_shard (the shard
group fastest, so `dp` keeps its rank order), and `dp` is their flattened product: `mesh["dp"]` is the same
group of ranks either way, and FSDP2 takes `mesh["dp_replicate", "dp_shard"]` (HSDP when dp_replicate > 1).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpcscale.layout import ParallelDims

AXES = ("pp", "dp", "tp")  # slowest to fastest: tp ranks are neighbours (inside a node), pp ranks farthest apart


def group_options(backend: str, timeout_s: float):
    """Options for one mesh dimension's groups on `backend` ("nccl" or "gloo") carrying `timeout_s`."""
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
    else:
        opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return opts


SHARDED_AXES = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(*, device_type: str, backend: str, dims: ParallelDims, timeout_s: float) -> DeviceMesh:
    """The job's mesh over every rank, dims named AXES (and dp_replicate, dp_shard when dims.dp_shard > 1), every
    group with the job's timeout. A collective."""
    if not dims.sharded:
        override = {axis: (backend, group_options(backend, timeout_s)) for axis in AXES}
        return init_device_mesh(
            device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=AXES, backend_override=override
        )
    override = {axis: (backend, group_options(backend, timeout_s)) for axis in SHARDED_AXES}
    mesh = init_device_mesh(
        device_type,
        (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp),
        mesh_dim_names=SHARDED_AXES,
        backend_override=override,
    )
    mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=(backend, group_options(backend, timeout_s)))
    return mesh


def group_timeout_s(group: dist.ProcessGroup, device_type: str) -> float:
    """The collective timeout a process group was built with, in seconds (what the tests check)."""
    import torch

    backend = group._get_backend(torch.device(device_type))
    return backend.options._timeout.total_seconds()

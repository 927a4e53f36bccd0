"""The (pp, dp, tp) DeviceMesh, its process groups built with the job's collective timeout.

torch's init_device_mesh makes each mesh dimension's groups with `new_group` (or `split_group` once NCCL is
eagerly initialised), and without options those get the backend's default timeout: 10 minutes for NCCL, 30 for
gloo, whatever `timeout_seconds` the job set for the default group. A hung tp or pp peer would then hold the
job far past the timeout its owner chose. Each dimension is given the backend's options with the job's timeout
(`backend_override`, which init_device_mesh passes to both ways of making the groups).
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


def build_mesh(*, device_type: str, backend: str, dims: ParallelDims, timeout_s: float) -> DeviceMesh:
    """The job's mesh over every rank, dims named AXES, every group with the job's timeout. A collective."""
    override = {axis: (backend, group_options(backend, timeout_s)) for axis in AXES}
    return init_device_mesh(device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=AXES, backend_override=override)


def group_timeout_s(group: dist.ProcessGroup, device_type: str) -> float:
    """The collective timeout a process group was built with, in seconds (what the tests check)."""
    import torch

    backend = group._get_backend(torch.device(device_type))
    return backend.options._timeout.total_seconds()

"""The job's DeviceMesh over the layout's axes (pp, dp, tp, ...), its process groups built with the job's
collective timeout.

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

from hpcscale.layout import DP, ParallelDims


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
    """The job's mesh over every rank, dims named dims.mesh_axes (the layout's axes, slowest first; `dp` in place
    of the data-parallel ones while nothing is sharded), every group with the job's timeout. A collective."""
    options = (backend, group_options(backend, timeout_s))
    mesh = init_device_mesh(
        device_type,
        dims.mesh_shape,
        mesh_dim_names=dims.mesh_axes,
        backend_override=dict.fromkeys(dims.mesh_axes, options),
    )
    if DP not in dims.mesh_axes:  # sharded: `dp` is the data-parallel axes flattened, the same ranks either way
        mesh[dims.dp_axes]._flatten(DP, backend_override=options)
    return mesh


def group_timeout_s(group: dist.ProcessGroup, device_type: str) -> float:
    """The collective timeout a process group was built with, in seconds (what the tests check)."""
    import torch

    backend = group._get_backend(torch.device(device_type))
    return backend.options._timeout.total_seconds()

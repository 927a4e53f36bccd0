"""What `hpcscale launch` does in every rank: read the run directory, bootstrap, build the mesh, run the entry.

Failures end the whole job fast: an exception in any rank is printed with its rank and node, then the rank
calls MPI_Abort, which makes srun/mpirun kill every rank at once; a rank that dies without a word is noticed
by srun (--kill-on-bad-exit) or mpirun; and every collective has a timeout (job spec `timeout_seconds`).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from hpcscale.config.load import LoadedJob
from hpcscale.errors import BadInput, HpcscaleError
from hpcscale.launch.signals import STOPPED_EXIT_CODE, StopFlag, StopRequested
from hpcscale.rundir import METRICS, RunDir, link_checkpoints, site_checkpoint_root
from hpcscale.util.paths import expand_path

# The reference trainer is loaded by name like any user's entry point: launch runs entry points, it does not
# know the trainer (hpcscale.train sits above launch and builds on its Context).
BUILTIN_ENTRY = "hpcscale.train.trainer:train"


def resolve_entry(entry: str) -> Callable:
    module, _, func = (BUILTIN_ENTRY if entry == "builtin" else entry).partition(":")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise BadInput(f"train.entry '{entry}' cannot be loaded: {e}") from None


def _order_nodes(loaded: LoadedJob) -> Callable[[list[str]], list[str]]:
    """Placement on the real allocation; hostname order if the switch tree cannot be read here."""

    def order(nodes: list[str]) -> list[str]:
        if len(nodes) == 1:
            return nodes
        from dataclasses import replace

        from hpcscale.slurm.allocation import place_job, site_tree
        from hpcscale.topology.tree import flat_tree

        try:
            tree = site_tree(loaded.site.config)
        except HpcscaleError as e:
            print(f"hpcscale launch: switch tree unavailable ({e}); placing as if flat", file=sys.stderr)
            tree = flat_tree(nodes)
        sized = LoadedJob(replace(loaded.spec, nodes=len(nodes)), loaded.path, loaded.site)
        return place_job(sized, nodes, tree=tree).nodes

    return order


def launch(run_dir: Path, *, sweep_index: int | None = None) -> int:
    """Run this rank; returns the process exit code (0, or STOPPED_EXIT_CODE after a stop request)."""
    from mpi4py import MPI

    stop = StopFlag()
    stop.install()  # before the slow imports: a signal during start-up is not lost
    loaded = RunDir(run_dir).load_job()
    spec = loaded.spec
    if spec.train is None:
        raise BadInput(f"{run_dir}/job.yaml has no `train:` entry; `command:` jobs run their program directly")
    from hpcscale.launch.bootstrap import bootstrap, node_name

    try:
        info = bootstrap(timeout_s=spec.timeout_seconds, order_nodes=_order_nodes(loaded))
        code = _run(loaded, info, run_dir, stop, sweep_index)
    except StopRequested:
        code = STOPPED_EXIT_CODE
    except Exception as e:
        # One line that names the rank and node, then the traceback; then take the whole job down now.
        rank = os.environ.get("HPCSCALE_RANK", "?")
        print(
            f"hpcscale launch: rank {rank} (MPI rank {MPI.COMM_WORLD.rank}) on node {node_name()} failed: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
            flush=True,
        )
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1
    return code


def _run(loaded: LoadedJob, info, run_dir: Path, stop: StopFlag, sweep_index: int | None) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hpcscale.launch.context import Context, MetricsLogger
    from hpcscale.layout import ParallelDims

    os.environ["HPCSCALE_RANK"] = str(info.rank)
    spec = loaded.spec
    dims = ParallelDims.for_world(world_size=info.world_size, tp=spec.parallel.tp, pp=spec.parallel.pp)
    device = torch.device("cuda", torch.cuda.current_device()) if info.backend == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
    coords = dims.coords(info.rank)
    params = dict(spec.train.params)
    point: dict = {}
    work_dir = run_dir
    if sweep_index is not None:
        if spec.sweep is None or not 0 <= sweep_index < spec.sweep.size:
            raise BadInput(f"--sweep-index {sweep_index}: the job has no such sweep point")
        point = spec.sweep.point(sweep_index)
        params.update(point)
        work_dir = run_dir / "sweep" / f"{sweep_index:04d}"
        work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_root = site_checkpoint_root(loaded.site.config)
    if checkpoint_root is not None:  # checkpoints on their own filesystem, under the run's name
        target = checkpoint_root / run_dir.name
        link_checkpoints(work_dir, target if sweep_index is None else target / "sweep" / work_dir.name)
    metrics = MetricsLogger(work_dir / METRICS if info.rank == 0 else None)
    ctx = Context(
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        node=info.node,
        dims=dims,
        pp_rank=coords.pp,
        dp_rank=coords.dp,
        tp_rank=coords.tp,
        mesh=mesh,
        device=device,
        backend=info.backend,
        run_dir=work_dir,
        job=spec,
        params=params,
        metrics=metrics,
        stop=stop,
        sweep_point=point,
        scratch=expand_path(loaded.site.config.filesystems.scratch),
    )
    try:
        resolve_entry(spec.train.entry)(ctx)
    finally:
        metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0

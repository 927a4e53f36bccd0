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

from hpcscale.config.load import LoadedJob, load_job
from hpcscale.errors import BadInput, HpcscaleError
from hpcscale.launch.signals import STOPPED_EXIT_CODE, StopFlag, StopRequested
from hpcscale.util.paths import expand_path


def load_run(run_dir: Path) -> LoadedJob:
    """The job as recorded in the run directory (job.yaml with its recorded site.yaml)."""
    if not (run_dir / "job.yaml").is_file():
        raise BadInput(f"{run_dir} is not an hpcscale run directory (no job.yaml)")
    return load_job(run_dir / "job.yaml", site=str(run_dir / "site.yaml"))


def resolve_entry(entry: str) -> Callable:
    if entry == "builtin":
        from hpcscale.train.trainer import train

        return train
    module, _, func = entry.partition(":")
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

        from hpcscale.topology.plan import place_job
        from hpcscale.topology.source import site_tree
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
    loaded = load_run(run_dir)
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
    from hpcscale.parallel.dims import ParallelDims
    from hpcscale.slurm.render import sweep_points

    os.environ["HPCSCALE_RANK"] = str(info.rank)
    spec = loaded.spec
    dims = ParallelDims.for_world(world_size=info.world_size, tp=spec.parallel.tp, pp=spec.parallel.pp)
    device = torch.device("cuda", torch.cuda.current_device()) if info.backend == "nccl" else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = dims.coords(info.rank)
    params = dict(spec.train.params)
    point: dict = {}
    work_dir = run_dir
    if sweep_index is not None:
        if spec.sweep is None:
            raise BadInput("--sweep-index given but the job has no sweep:")
        point = sweep_points(spec.sweep.params)[sweep_index]
        params.update(point)
        work_dir = run_dir / "sweep" / f"{sweep_index:04d}"
        work_dir.mkdir(parents=True, exist_ok=True)
    metrics = MetricsLogger(work_dir / "metrics.jsonl" if info.rank == 0 else None)
    ctx = Context(
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        node=info.node,
        dims=dims,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
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

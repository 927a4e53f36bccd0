"""The environment hpcscale adds for a job's ranks beyond what the job and its site set, wherever they start:
the batch script's srun (slurm.render) and `run --local`'s mpirun (launch.local). One rule for both, here.

glibc's malloc raises its mmap threshold to the largest block freed (up to 32 MiB), after which freed big blocks
stay in its heap instead of going back to the system: the blocks FSDP gathers and frees every step then keep a
sharded CPU rank's memory at the replicated level. A fixed threshold of 1 MiB returns every block over it when
freed (a block's gathered parameters, in any model worth sharding) and keeps smaller ones in the heap: at glibc's
own starting value, 128 KiB, every activation and gradient buffer over it was mapped and zero-filled anew each
step, 20 % more step time on a small model (docs/large-models.md). GPU ranks gather into device memory, and a
`command:` job's program is the user's own: neither gets it.
"""

from __future__ import annotations

from collections.abc import Mapping

from hpcscale.config.job import JobSpec

CPU_RANK_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def ranks_on_cpu(spec: JobSpec) -> bool:
    """Whether a job's ranks compute on CPUs wherever a batch script runs them: `device: cpu`, or `auto` without
    GPUs requested."""
    return spec.device == "cpu" or (spec.device == "auto" and not spec.gpus_per_node)


def rank_defaults(spec: JobSpec, variables: Mapping[str, str], *, on_cpu: bool) -> dict[str, str]:
    """What hpcscale adds to the environment of a `train:` job's ranks on CPUs: CPU_RANK_ENVIRONMENT, less the
    names `variables` (the site's and the job's `environment`) sets. Where the ranks start, a non-empty value
    in the environment they inherit wins too (the batch script exports `${NAME:-default}`; run_local checks its
    own environment); an empty one does not count (glibc would read it as 0 and map every allocation)."""
    if not on_cpu or spec.train is None:
        return {}
    return {name: value for name, value in CPU_RANK_ENVIRONMENT.items() if name not in variables}

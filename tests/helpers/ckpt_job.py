"""Multi-rank checkpoint driver for fault tests, run under mpirun:

    ckpt_job.py ROOT save STEP [STEP...]   save these steps (tensors change each step), keep_last from KEEP env
    ckpt_job.py ROOT load                  load the newest verified checkpoint; print its step and a checksum
    ckpt_job.py OUT load-each ROOT...      `load` of each ROOT in turn, a fresh manager each, in one start-up of
                                           the ranks: each rank's output for the i-th ROOT in OUT/i.rank-R.log,
                                           rank 0's answer in OUT/i.json

HPCSCALE_CKPT_FAULT in the environment kills a rank at the named point (hpcscale.ckpt.faults).
"""

import json
import os
import sys
from pathlib import Path

import rankstart  # first: the imports below run with the collector paused
import torch

from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.launch.bootstrap import bootstrap
from hpcscale.layout import ParallelDims

rankstart.imported()

root, action, *steps = sys.argv[1:]
info = bootstrap(timeout_s=60, order_nodes=lambda nodes: nodes)
dims = ParallelDims(pp=1, dp=info.world_size, tp=1)


def manager_of(root: str) -> CheckpointManager:
    return CheckpointManager(Path(root), dims=dims, rank=info.rank, keep_last=int(os.environ.get("KEEP", "10")))


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)} | {"frozen": torch.ones(512, 512)}


def load(root: str) -> str | None:
    """The newest checkpoint of `root` that loads, into zeroed tensors; rank 0's answer as a JSON line."""
    target = {k: torch.zeros_like(v) for k, v in tensors(0).items()}
    restored = manager_of(root).load_latest(target)
    if info.rank != 0:
        return None
    ok = restored is not None and all(torch.equal(target[k], v) for k, v in tensors(restored.step).items())
    return json.dumps({"step": restored.step if restored else None, "matches": ok})


if action == "save":
    manager = manager_of(root)
    for s in map(int, steps):
        manager.save(s, tensors(s), {"step": s}, asynchronous=False)
elif action == "load-each":
    streams = os.dup(1), os.dup(2)
    for i, each in enumerate(steps):
        sys.stdout.flush()
        sys.stderr.flush()
        with open(Path(root) / f"{i}.rank-{info.rank}.log", "w") as log:
            os.dup2(log.fileno(), 1)  # the descriptors, not sys.stdout/err: what any layer writes lands here
            os.dup2(log.fileno(), 2)
            answer = load(each)
            sys.stdout.flush()
            sys.stderr.flush()
        if answer is not None:
            (Path(root) / f"{i}.json").write_text(answer + "\n")
    os.dup2(streams[0], 1)
    os.dup2(streams[1], 2)
else:
    answer = load(root)
    if answer is not None:
        print(answer, flush=True)
torch.distributed.destroy_process_group()  # before exit: gloo's threads must not outlive the interpreter
rankstart.finish()

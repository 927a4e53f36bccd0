"""Multi-rank checkpoint driver for fault tests, run under mpirun:

    ckpt_job.py ROOT save STEP [STEP...]   save these steps (tensors change each step), keep_last from KEEP env
    ckpt_job.py ROOT load                  load the newest verified checkpoint; print its step and a checksum

HPCSCALE_CKPT_FAULT in the environment kills a rank at the named point (hpcscale.ckpt.faults).
"""

import json
import os
import sys
from pathlib import Path

import torch

from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.launch.bootstrap import bootstrap
from hpcscale.layout import ParallelDims

root, action, *steps = sys.argv[1:]
info = bootstrap(timeout_s=60, order_nodes=lambda nodes: nodes)
dims = ParallelDims(pp=1, dp=info.world_size, tp=1)
manager = CheckpointManager(Path(root), dims=dims, rank=info.rank, keep_last=int(os.environ.get("KEEP", "10")))


def tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)} | {"frozen": torch.ones(512, 512)}


if action == "save":
    for s in map(int, steps):
        manager.save(s, tensors(s), {"step": s}, asynchronous=False)
else:
    target = {k: torch.zeros_like(v) for k, v in tensors(0).items()}
    restored = manager.load_latest(target)
    if info.rank == 0:
        ok = restored is not None and all(torch.equal(target[k], v) for k, v in tensors(restored.step).items())
        print(json.dumps({"step": restored.step if restored else None, "matches": ok}), flush=True)
torch.distributed.destroy_process_group()  # before exit: gloo's threads must not outlive the interpreter

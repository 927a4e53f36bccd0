"""One rank of a two-tier restart test (tests/trust/test_trust_residuals.py): real gloo, real files, emulated nodes, the
restart's tier choice made by ctx.checkpoint's own code (Checkpointer._load_newest).

    python tier_restore_ranks.py SPEC_JSON RANK

SPEC: {"world", "store", "base", "nodes": [node of each rank], "action": "build" | "restore", "out"}; each emulated
node's directory is BASE/<node>, the shared tier BASE/shared.
- build: {"steps": [...], "drain": [...]} saves each step to the node-local tier, and drains those in `drain` to
  the shared tier;
- restore: loads what a restart loads, writes {"step", "tier", "why", "ok"} and, for each step of "then" (saved to
  the node-local tier first unless it is the step restored), drains it to the shared tier: {"drains": {step:
  {"new", "referenced"}}}.
Tensor values depend on the step, but for one tensor that never changes (a drain references its chunks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import rankstart  # first: the imports below run with the collector paused
import torch
import torch.distributed as dist
from nodelocal_ranks import tensors_at

from hpcscale.ckpt import nodelocal
from hpcscale.ckpt.local_tier import NodeLocalManager
from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.launch.checkpointing import FORMAT, Checkpointer
from hpcscale.layout import ParallelDims

rankstart.imported()


def state(step: int) -> dict:
    return {"step": step, "hpcscale.context": FORMAT, "objects": {}}  # what ctx.checkpoint saves, no optimizer


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank, world = int(sys.argv[2]), spec["world"]
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    nodes = spec["nodes"]
    base = Path(spec["base"])
    dims = ParallelDims.for_world(world_size=world, tp=1, pp=1)
    layout = nodelocal.build(nodes, 1, {}, [], "other")
    local = NodeLocalManager(base / nodes[rank], dims=dims, rank=rank, keep_last=10, node_local=layout)
    shared = CheckpointManager(base / "shared", dims=dims, rank=rank, keep_last=10)
    out: dict = {}
    if spec["action"] == "build":
        for step in spec["steps"]:
            local.save(step, tensors_at(step), state(step), asynchronous=False)
            if step in spec["drain"]:
                shared.drain(local.root, step)
                shared.wait()
    else:
        ctx = SimpleNamespace(job=SimpleNamespace(checkpoint=None, xsite=None, train=SimpleNamespace(entry="t")))
        checkpointer = Checkpointer(ctx)
        checkpointer._manager, checkpointer._local_manager = shared, local
        target = {k: torch.zeros_like(v) for k, v in tensors_at(0).items()}
        choice = checkpointer._load_newest(target)
        step = choice.restored.step if choice.restored is not None else None
        want = tensors_at(step) if step is not None else {}
        out = {
            "step": step,
            "tier": choice.tier,
            "why": choice.why,
            "ok": all(torch.equal(target[k], want[k]) for k in want),
        }
        out["drains"] = {}
        for n in spec.get("then", []):
            if n != step:
                local.save(n, tensors_at(n), state(n), asynchronous=False)
            shared.drain(local.root, n)
            shared.wait()
            stats = shared.last_stats  # None: nothing was drained (the step taken as on the shared tier already)
            out["drains"][n] = stats and {"new": stats.new_bytes, "referenced": stats.referenced_bytes}
    shared.close()
    local.close()
    Path(f"{spec['out']}.rank-{rank}").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    rankstart.finish()

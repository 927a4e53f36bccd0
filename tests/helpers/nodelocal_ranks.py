"""One rank of a node-local tier test (tests/ckpt/test_nodelocal.py): real gloo, real files, emulated nodes.

    python nodelocal_ranks.py SPEC_JSON RANK

SPEC: {"world", "store", "base", "nodes": [node of each rank], "partners", "action": "save" | "load" | "drain",
"steps", "out"}. Each emulated node's directory is BASE/<node>. `save` writes the given steps (the tensors' values
depend on the step); `load` loads the newest complete step and writes {"step", "ok", "moved"} to OUT.rank-R;
`drain` saves each step to the node-local tier, then drains it to the shared tier in BASE/shared, and writes
what each drain wrote and referenced.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import rankstart  # first: the imports below run with the collector paused
import torch
import torch.distributed as dist

from hpcscale.ckpt import nodelocal
from hpcscale.ckpt.local_tier import NodeLocalManager
from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.layout import ParallelDims

rankstart.imported()


def tensors_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    frozen = torch.Generator().manual_seed(12345)  # a tensor that never changes: a drain writes it once
    return {f"w{i}": torch.randn(64, 257, generator=g) for i in range(6)} | {
        "frozen": torch.randn(1 << 18, generator=frozen).to(torch.bfloat16)
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = int(sys.argv[2])
    world = spec["world"]
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    nodes = spec["nodes"]
    layout = nodelocal.build(nodes, spec["partners"], {}, [], "other")
    root = Path(spec["base"]) / nodes[rank]
    lineage = {"hpcscale_version": "test"} if rank == 0 else None  # as the launcher gives both tiers
    dims = ParallelDims.for_world(world_size=world, tp=1, pp=1)
    manager = NodeLocalManager(root, dims=dims, rank=rank, keep_last=2, node_local=layout, lineage=lineage)
    out = {}
    if spec["action"] == "save":
        for step in spec["steps"]:
            try:
                manager.save(step, tensors_at(step), {"step": step}, asynchronous=spec.get("async", False))
                manager.wait()
                out[step] = "saved"
            except Exception as e:
                out[step] = f"{type(e).__name__}: {e}"
    elif spec["action"] == "drain":
        shared = CheckpointManager(Path(spec["base"]) / "shared", dims=dims, rank=rank, keep_last=5, lineage=lineage)
        for step in spec["steps"]:
            manager.save(step, tensors_at(step), {"step": step}, asynchronous=False)
            shared.drain(manager.root, step)
            shared.wait()
            out[step] = {"new": shared.last_stats.new_bytes, "referenced": shared.last_stats.referenced_bytes}
        shared.close()
    else:
        target = {k: torch.zeros_like(v) for k, v in tensors_at(0).items()}
        restored = manager.load_node_local(target, at_least=spec.get("at_least"))
        if restored is None:
            out = {"step": None}
        else:
            want = tensors_at(restored.step)
            out = {
                "step": restored.step,
                "ok": all(torch.equal(target[k], want[k]) for k in want),
                "moved": list(manager.moved),
            }
    manager.close()
    Path(f"{spec['out']}.rank-{rank}").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    rankstart.finish()

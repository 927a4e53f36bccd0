"""Two gloo ranks as one tp group (`torchrun --nproc-per-node 2 tp_grads_ranks.py OUT`): hpcscale.parallel.tp_grads's
comparison on hand-made gradients, one case per name, each rank's answer written to OUT.<rank>.json."""

import json
import sys

import rankstart  # first: the imports below run with the collector paused
import torch
import torch.distributed as dist

from hpcscale.parallel.tp_grads import spreads

rankstart.imported()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = torch.linspace(-1.0, 2.0, 1000)
    nan = torch.full((3,), float("nan"))
    cases = {  # name -> this rank's gradient
        "equal": base.clone(),
        "one ulp apart": base + (rank * 1e-7) * base.abs(),  # the rounding of a reduction in another order
        "one part in a thousand": base * (1 + rank * 1e-3),
        "a different share": base * (rank + 1),
        "permuted sign": base * (1 if rank == 0 else -1),
        "zero": torch.zeros(5),
        "none on one rank": None if rank == 1 else base.clone(),
        "none anywhere": None,
        "nan everywhere": nan.clone(),
        "nan on one rank": nan.clone() if rank == 1 else torch.ones(3),
        "bf16 equal": base.to(torch.bfloat16),
    }
    found = spreads(list(cases.items()), group=dist.group.WORLD, device=torch.device("cpu"))
    with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
        json.dump({s.name: s.why for s in found}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    rankstart.finish()

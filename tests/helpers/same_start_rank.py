"""One rank of the test that a round-0 mismatch seen by one tensor-parallel rank only is refused by every
rank together (hpcscale.launch.site_rounds.Rounds._same_start): 2 ranks, tp = 2, θ(0) differs from the weights in
rank 0's shard alone. Writes OUT/rank-N.json (OUT: the first argument): what this rank raised. A file, not
stdout, where mpirun may glue two ranks' lines into one."""

import json
import os
import sys
import types
from datetime import timedelta

from mpi4py import MPI

comm = MPI.COMM_WORLD

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module  # noqa: E402

from hpcscale.launch.site_rounds import Rounds  # noqa: E402

store = dist.TCPStore("127.0.0.1", 0, comm.size, is_master=True, wait_for_workers=False) if comm.rank == 0 else None
port = comm.bcast(store.port if store else None, root=0)
if store is None:
    store = dist.TCPStore("127.0.0.1", port, comm.size, is_master=False)
dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size, timeout=timedelta(seconds=20))
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
theta = {f"{n}": p.detach().clone() for n, p in model.named_parameters()}
theta["0.weight"][0, 0] += 1.0  # row 0 of a column-parallel weight: rank 0's shard only
parallelize_module(model, mesh, {"0": ColwiseParallel()})
fake = types.SimpleNamespace(model=model, ctx=types.SimpleNamespace(device=torch.device("cpu")))
fake.ctx.job = types.SimpleNamespace(xsite=types.SimpleNamespace(start_from="/pretrained/checkpoints"))
fake._shard = types.MethodType(Rounds._shard, fake)
try:
    Rounds._same_start(fake, theta)
    raised = None
except Exception as e:
    raised = f"{type(e).__name__}: {e}"
with open(f"{sys.argv[1]}/rank-{comm.rank}.json", "w") as f:
    json.dump({"rank": comm.rank, "raised": raised}, f)
dist.destroy_process_group()
# Out without the interpreter's teardown, as `hpcscale launch` ends: a gloo thread still dropping a tensor while
# the interpreter finalizes aborts the process (SIGABRT in PyEval_AcquireThread), seldom but in this test.
MPI.Finalize()
os._exit(0)

"""A user entry point that ends as an NCCL collective timeout does on GPUs, for the diagnosis test on the CPU
cluster: every rank but the last writes the watchdog's line in torch's own format and dies of SIGABRT, as
ProcessGroupNCCL's watchdog makes it; the last rank never reaches the collective (it sleeps until srun kills
it). Only the failure's shape is emulated; what reads it (srun's report, the logs, resume) is all real."""

import os
import sys
import time

import torch.distributed as dist


def main(ctx):
    dist.barrier()
    if ctx.rank == ctx.world_size - 1:
        time.sleep(600)
        return
    time.sleep(1.0)
    print(
        f"[rank{ctx.rank}]:[E1125 10:00:00.426415540 ProcessGroupNCCL.cpp:632] [PG ID 2 PG GUID 5(mesh_dp) Rank "
        f"{ctx.rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, "
        "NumelIn=1024, NumelOut=1024, Timeout(ms)=20000) ran for 20004 milliseconds before timing out.",
        file=sys.stderr,
        flush=True,
    )
    os.abort()

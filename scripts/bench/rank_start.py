#!/usr/bin/env python3
"""A rank's start-up with Python's cyclic garbage collector on, and paused as `hpcscale launch` runs it
(hpcscale.util.pystart: paused for the start-up, then the start-up's objects frozen and the collector back on).

Each case runs N times in fresh processes, the two cases alternating, measured side by side in one run (the
ratios hold on a noisy machine). A case imports what a rank imports before its entry point is called (torch,
torch.distributed with its FSDP, DTensor and state-dict packages, mpi4py's MPI, hpcscale's launch, mesh and
checkpointing modules), then torch._dynamo, which the entry's first optimizer imports (torch.optim wraps
add_param_group with torch._disable_dynamo), then times one full collection (`gc.collect()`): the pause a
training loop's full pass costs once start-up is done. CPU seconds of the process (user + system).

    python scripts/bench/rank_start.py [-n 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import gc, json, resource, sys, time
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
from hpcscale.util import pystart
paused = sys.argv[1] == "paused"
if paused:
    pystart.pause_collector()
import torch, torch.distributed, torch.distributed.fsdp, torch.distributed.tensor
import torch.distributed.checkpoint.state_dict
from mpi4py import MPI
import hpcscale.launch.main, hpcscale.parallel.mesh, hpcscale.launch.checkpointing
start_up = cpu()
if paused:
    pystart.resume_collector()
import torch._dynamo
with_dynamo = cpu()
t = time.process_time()
gc.collect()
print(json.dumps({"start_up_s": start_up, "with_dynamo_s": with_dynamo, "full_pass_s": time.process_time() - t}))
"""

CASES = {"collector on": "on", "paused": "paused"}  # the row's name -> the child's argument


def one(case: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, CASES[case]], capture_output=True, text=True, cwd="/", check=True, timeout=300
    )
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    samples: dict[str, list[dict]] = {c: [] for c in CASES}
    for _ in range(a.n):  # alternating: drift hits both cases alike
        for case in CASES:
            samples[case].append(one(case))
    keys = ("start_up_s", "with_dynamo_s", "full_pass_s")
    med = {c: {k: statistics.median(s[k] for s in samples[c]) for k in keys} for c in CASES}
    base = med["collector on"]
    result = {
        "runs": a.n,
        "median": med,
        "ratio_paused_over_on": {k: round(med["paused"][k] / base[k], 3) if base[k] else None for k in keys},
    }
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"a rank's start-up, CPU seconds, medians of {a.n} fresh processes per case, alternating")
    print(f"{'case':14s} {'start-up':>9s} {'+ _dynamo':>10s} {'full gc pass':>13s}")
    for c in CASES:
        m = med[c]
        print(f"{c:14s} {m['start_up_s']:9.2f} {m['with_dynamo_s']:10.2f} {m['full_pass_s']:13.3f}")
    r = result["ratio_paused_over_on"]
    print(f"{'paused / on':14s} {r['start_up_s']:9.3f} {r['with_dynamo_s']:10.3f} {r['full_pass_s']:13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Placement: time to place 4096 nodes, cost against hostname order, and exactness on small allocations.

The 4096-node cluster has 32-node leaf switches, 16 leaves per spine, one core; hostnames are shuffled over
the cabling (as after repairs and expansions), so hostname order is a realistic baseline. Small allocations
(<= 8 nodes) are checked against brute force over every node order.

    python scripts/bench/placement.py [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time

from hpcscale.layout import JobLayout
from hpcscale.topology.placement import TrafficWeights, place, placement_cost, slot_edges
from hpcscale.topology.tree import build_tree

TARGET_S = 1.0


def big_tree(n: int, per_leaf: int = 32, leaves_per_spine: int = 16, seed: int = 1):
    hosts = [f"gpu{i:05d}" for i in range(n)]
    wired = hosts[:]
    random.Random(seed).shuffle(wired)
    leaves = n // per_leaf
    entries = [(f"leaf{k:04d}", wired[k * per_leaf : (k + 1) * per_leaf], None) for k in range(leaves)]
    spines = (leaves + leaves_per_spine - 1) // leaves_per_spine
    entries += [
        (
            f"spine{s:02d}",
            None,
            [f"leaf{k:04d}" for k in range(s * leaves_per_spine, min(leaves, (s + 1) * leaves_per_spine))],
        )
        for s in range(spines)
    ]
    entries.append(("core", None, [f"spine{s:02d}" for s in range(spines)]))
    return hosts, build_tree(entries)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    hosts, tree = big_tree(4096)
    large = []
    for tpn, tp, pp in [(8, 8, 8), (8, 4, 16), (4, 4, 1)]:
        layout = JobLayout(nodes=4096, tasks_per_node=tpn, tp=tp, pp=pp)
        t = time.perf_counter()
        p = place(nodes=hosts, tree=tree, layout=layout)
        dt = time.perf_counter() - t
        large.append(
            {
                "nodes": 4096,
                "tasks_per_node": tpn,
                "tp": tp,
                "pp": pp,
                "dp": layout.dp,
                "seconds": round(dt, 3),
                "cost_vs_hostname_order": round(p.cost / p.hostname_order_cost, 3),
                "method": p.method,
                "target_met": dt <= TARGET_S,
            }
        )
    rng = random.Random(3)
    small = {"cases": 0, "equal_to_brute_force": 0, "seconds_place": 0.0, "seconds_brute": 0.0}
    for _ in range(20):
        n = rng.randint(4, 8)
        small_hosts, small_tree = big_tree(n, per_leaf=rng.choice([2, 3]), leaves_per_spine=2, seed=rng.randint(0, 99))
        tpn = rng.choice([1, 2, 4])
        tp = rng.choice([t for t in (1, 2, 4) if tpn % t == 0])
        pp = rng.choice([p for p in (1, 2, 4) if (n * tpn) % (tp * p) == 0])
        layout = JobLayout(nodes=len(small_hosts), tasks_per_node=tpn, tp=tp, pp=pp)
        if len(small_hosts) != n:
            continue
        t = time.perf_counter()
        p = place(nodes=small_hosts, tree=small_tree, layout=layout)
        small["seconds_place"] += time.perf_counter() - t
        t = time.perf_counter()
        edges = slot_edges(layout, TrafficWeights())
        best = min(placement_cost(list(o), edges, small_tree) for o in itertools.permutations(small_hosts))
        small["seconds_brute"] += time.perf_counter() - t
        small["cases"] += 1
        small["equal_to_brute_force"] += abs(p.cost - best) < 1e-9
    small["seconds_place"] = round(small["seconds_place"], 3)
    small["seconds_brute"] = round(small["seconds_brute"], 3)
    ok = all(r["target_met"] for r in large) and small["cases"] == small["equal_to_brute_force"]
    if a.json:
        print(json.dumps({"target_s": TARGET_S, "large": large, "small": small, "ok": ok}, indent=2))
    else:
        print(f"{'layout (tpn,tp,pp,dp)':24} {'seconds':>8} {'cost / hostname order':>22}  method")
        for r in large:
            print(
                f"{(r['tasks_per_node'], r['tp'], r['pp'], r['dp'])!s:24} {r['seconds']:8.3f} "
                f"{r['cost_vs_hostname_order']:22.3f}  {r['method']}"
            )
        print(
            f"small allocations (<= 8 nodes): {small['equal_to_brute_force']}/{small['cases']} equal to brute force "
            f"(place {small['seconds_place']}s total, brute force {small['seconds_brute']}s)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

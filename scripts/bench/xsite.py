#!/usr/bin/env python3
"""Cross-site rounds: bytes per round for each encoding, and the time of each stage of a sync tick.

Two sites a (aggregator) and b on this machine, a model of --params parameters (default 100 M) held as real
hpcscale checkpoints in each site's run directory (a start checkpoint, then a round checkpoint with each site's
own weights), and the product's ticks (hpcscale.xsite.rounds.tick), in-process, timed stage by stage:
  export (read the round checkpoint whole, Δ, encode, sign: site b's tick), push (stage to the aggregator),
  aggregate (validate both contributions, the outer step, publish θ and m signed, and the θ-only copy sites
  get), push round and hand over. "round in MB" is what b receives per round.
With --link RATE (root; e.g. 20mbit) the exchange goes through an sshd in a network namespace whose loopback
is capped by tbf, and the round time (from b's export to θ(1) in b's run) shows what the link costs.
Each encoding runs with each --compressions value (the cross-site config's compression), side by side.

    python scripts/bench/xsite.py [--params 100e6] [--reps 5] [--link 20mbit] [--compressions zstd,none]
                                   [--warmup] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "helpers"))


def make_checkpoints(run: Path, theta, site_theta) -> None:
    """run/checkpoints: step 0 (start, base -1) with theta, step H (base 0) with site_theta; run/job.yaml."""
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    (run / "checkpoints").mkdir(parents=True)
    (run / "job.yaml").write_text("name: bench\n")
    m = CheckpointManager(run / "checkpoints", dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, keep_last=5)
    m.save(0, {f"model/{k}": v for k, v in theta.items()}, {"xsite": {"base_round": -1}}, asynchronous=False)
    state = {"xsite": {"base_round": 0, "since": 0, "steps": 10, "tokens": 10_000}}
    m.save(10, {f"model/{k}": v for k, v in site_theta.items()}, state, asynchronous=False)


def one(tmp: Path, params: int, encoding: str, compression: str, ssh: list[str] | None, url) -> dict:
    import torch
    import yaml

    from hpcscale.config.xsite import load_xsite
    from hpcscale.xsite import rounds
    from hpcscale.xsite.signing import generate_key

    keys = tmp / "keys"
    keys.mkdir()
    for s in ("a", "b"):
        (tmp / f"priv-{s}").mkdir()
        generate_key(tmp / f"priv-{s}", s)
        (keys / f"{s}.pub").write_bytes((tmp / f"priv-{s}" / f"{s}.pub").read_bytes())
    g = torch.Generator().manual_seed(0)
    n_tensors = 16
    theta = {f"w{i}": torch.randn(params // n_tensors, generator=g) for i in range(n_tensors)}
    for s in ("a", "b"):
        make_checkpoints(
            tmp / f"run-{s}", theta, {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in theta.items()}
        )
    cfg = {
        "name": "bench",
        "aggregator": "a",
        "round_steps": 10,
        "encoding": encoding,
        "compression": compression,
        "keys": str(keys),
        "quorum": {"min_sites": 2},
        "sites": [
            {"name": s, "run": str(tmp / f"run-{s}"), "state": str(tmp / f"state-{s}"),
             "reach": url(tmp / f"state-{s}") if url else str(tmp / f"state-{s}"),
             "key": str(tmp / f"priv-{s}" / f"{s}.key")}
            for s in ("a", "b")
        ],
    }  # fmt: skip
    if ssh:
        cfg["ssh"] = ssh
    (tmp / "x.yaml").write_text(yaml.safe_dump(cfg))
    config = load_xsite(tmp / "x.yaml")

    def timed(site: str) -> tuple[float, rounds.TickReport]:
        t = time.perf_counter()
        report = rounds.tick(config, site)
        assert not report.errors, report.errors
        return time.perf_counter() - t, report

    setup_s, _ = timed("a")  # round 0 published, pushed to a and b, handed to a; a's contribution exported
    t0 = time.perf_counter()
    b_s, b_report = timed("b")  # b: θ(0) handed over, b's contribution exported (Δ, encode, sign) and pushed
    agg_s, agg_report = timed("a")  # a: validate both, outer step, publish round 1, push its θ-only copy to both
    hand_s, _ = timed("b")  # b: verify round 1, hand θ(1) to b's run
    round_s = time.perf_counter() - t0
    assert (tmp / "run-b" / "xsite" / "global-r000001.safetensors").exists()
    sent_b = sum(e.get("bytes", 0) for e in b_report.events if e["event"] == "pushed")
    contrib = next(e for e in b_report.events if e["event"] == "exported")["bytes"]
    down = sum(e["bytes"] for e in agg_report.events if e["event"] == "pushed" and e.get("to") == "b")
    return {
        "encoding": encoding,
        "compression": compression,
        "params": params,
        "fp32_model_bytes": 4 * params,
        "contribution_bytes": contrib,
        "contribution_vs_fp32": round(contrib / (4 * params), 4),
        "b_sent_bytes": sent_b,
        "b_received_bytes": down,  # round 1 as b receives it: θ only (the momentum stays at the aggregator)
        "tick_b_export_push_s": round(b_s, 2),
        "tick_a_aggregate_publish_push_s": round(agg_s, 2),
        "tick_b_hand_over_s": round(hand_s, 2),
        "round_s": round(round_s, 2),
        "first_tick_a_s": round(setup_s, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--encodings", default="fp32,bf16,int8")
    ap.add_argument("--compressions", default="zstd,none")
    ap.add_argument("--link", default=None, help="cap the exchange at this tbf rate (needs root), e.g. 20mbit")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--warmup",
        action="store_true",
        help="one untimed round of each configuration first: the medians are then the steady state of a "
        "long-lived process (imports done, allocator warm); without it the first repetition of the first "
        "configuration also pays what a fresh `hpcscale sync` process pays",
    )
    a = ap.parse_args()
    inside = os.environ.get("HPCSCALE_BENCH_SSHD")
    if a.link and not inside:
        # The sshd and this process's ssh clients must both be in the capped namespace: start the sshd there,
        # then run this script again inside it, told how to reach the sshd.
        from sshd import LoopbackSshd, capped_netns

        with capped_netns(f"hpcscale-bench-{os.getpid()}", a.link) as ns, tempfile.TemporaryDirectory() as d:
            server = LoopbackSshd(Path(d), netns=ns).start()
            try:
                info = json.dumps({"ssh": server.ssh_command(), "port": server.port})
                return subprocess.call(["ip", "netns", "exec", ns, sys.executable, *sys.argv],
                                       env={**os.environ, "HPCSCALE_BENCH_SSHD": info})  # fmt: skip
            finally:
                server.stop()
    ssh, url = None, None
    if inside:
        info = json.loads(inside)
        ssh = info["ssh"]

        def url(path: Path) -> str:
            return f"ssh://127.0.0.1:{info['port']}{os.path.abspath(path)}"

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    results = []
    configs = [(e, c) for e in a.encodings.split(",") for c in a.compressions.split(",")]
    if a.warmup:
        for enc, comp in configs:
            with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
                one(Path(d), int(a.params), enc, comp, ssh, url)
    for _ in range(a.reps):  # the configurations alternate within each repetition: the machine's drift hits all
        for enc, comp in configs:
            with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
                results.append(one(Path(d), int(a.params), enc, comp, ssh, url))
    rows = []
    for enc, comp in configs:
        rs = [r for r in results if (r["encoding"], r["compression"]) == (enc, comp)]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float | int)}
        rows.append({"encoding": enc, "compression": comp, **med, "reps": len(rs)})
    if a.json:
        print(json.dumps({"link": a.link, "rows": rows, "runs": results}, indent=2))
        return 0
    print(f"cross-site tick, {a.params / 1e6:.0f} M parameters ({4 * a.params / 1e6:.0f} MB fp32), 2 sites, "
          f"link {a.link or 'none (shared filesystem)'}; medians of {a.reps}")  # fmt: skip
    print(f"  {'encoding':8} {'compress':8} {'contrib MB':>10} {'vs fp32':>8} {'round in MB':>11} "
          f"{'b export+push s':>16} {'a aggregate s':>14} {'b hand-over s':>14} {'round s':>8}")  # fmt: skip
    for r in rows:
        print(f"  {r['encoding']:8} {r['compression']:8} {r['contribution_bytes'] / 1e6:10.1f} "
              f"{r['contribution_vs_fp32']:8.3f} {r['b_received_bytes'] / 1e6:11.1f} "
              f"{r['tick_b_export_push_s']:16.2f} {r['tick_a_aggregate_publish_push_s']:14.2f} "
              f"{r['tick_b_hand_over_s']:14.2f} {r['round_s']:8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

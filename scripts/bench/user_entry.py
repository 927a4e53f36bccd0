#!/usr/bin/env python3
"""A user's own model under hpcscale against torch DDP: step time of docs/context-api.md's loop, in one run.

The model is the page's own `Classifier` (taken from docs/context-api.md as the tests take it), made larger
so that gradient communication weighs (--dim, --layers). Each repetition is one `hpcscale run --local -n 2`
(dp=2, gloo, the real launch path); in it every rank builds three copies of the model from the same seed and
times full steps (forward, backward, AdamW) in alternating blocks, so the shared machine's drift hits all
alike:
- hpcscale: `ctx.parallelize(model)` and the loop as the page writes it, `ctx.checkpoint.step(step)`
  included (the job has no checkpoint period, so what it costs is the stop-signal all-reduce and the
  watchdog beat);
- ddp: `torch.nn.parallel.DistributedDataParallel(model)`, the loop a plain DDP user writes;
- per-parameter: one all_reduce per gradient after backward, what the page documented before.
The ratio is median(hpcscale) / median(ddp); target <= 1.05 in most repetitions.

The sharded row is a second `hpcscale run` per repetition with `parallel.dp_shard: 2`: `ctx.parallelize(model)`
(FSDP2 per encoder layer and at the root, the job's settings) against the same model under a plain script's
`fully_shard` calls (per layer, then the root, over the same two ranks), alternating in the same way; the
ratio is median(hpcscale) / median(fully_shard), target <= 1.05.

    python scripts/bench/user_entry.py [--repeat 5] [--steps 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = 1.05


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def bench_entry(ctx) -> None:
    """The entry point each rank runs (train.entry: user_entry:bench_entry)."""
    import torch
    import torch.distributed as dist
    from mymodel import Batches, Classifier
    from torch import nn

    p = ctx.params
    torch.set_num_threads(1)
    dp_group = ctx.mesh["dp"].get_group()

    def build():
        torch.manual_seed(0)
        return Classifier(dim=p["dim"], layers=p["layers"], heads=p["heads"])

    ours = ctx.parallelize(build())
    if p["sharded"]:  # parallel.dp_shard = 2: FSDP2 by ctx.parallelize against fully_shard called by hand
        from torch.distributed.fsdp import fully_shard

        other = build()
        for layer in other.encoder.layers:
            fully_shard(layer, mesh=ctx.mesh["dp_shard"])
        fully_shard(other, mesh=ctx.mesh["dp_shard"])
        setups = {
            "hpcscale": (ours, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
            "fully_shard": (other, torch.optim.AdamW(other.parameters(), lr=1e-4)),
        }
    else:
        ddp = nn.parallel.DistributedDataParallel(build(), process_group=dp_group)
        other = ddp.module
        plain = build()
        setups = {
            "hpcscale": (ours, torch.optim.AdamW(ours.parameters(), lr=1e-4)),
            "ddp": (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)),
            "per_parameter": (plain, torch.optim.AdamW(plain.parameters(), lr=1e-4)),
        }
    ctx.checkpoint.restore(ours, setups["hpcscale"][1])
    data = Batches(ctx, batch=p["batch"])
    tokens, labels = data.next()
    counter = {"hpcscale": 0}

    def step(kind: str) -> float:
        model, opt = setups[kind]
        dist.barrier()
        t = time.perf_counter()
        loss = nn.functional.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        if kind == "per_parameter":
            for param in model.parameters():
                dist.all_reduce(param.grad, group=dp_group)
                param.grad /= ctx.dims.dp
        opt.step()
        if kind == "hpcscale":
            ctx.checkpoint.step(counter["hpcscale"])
            counter["hpcscale"] += 1
        return time.perf_counter() - t

    for kind in setups:  # warm-up
        step(kind)
        step(kind)
    times: dict[str, list[float]] = {kind: [] for kind in setups}
    blocks = 5
    for _ in range(blocks):
        for kind in setups:
            times[kind] += [step(kind) for _ in range(max(1, p["steps"] // blocks))]
    a = torch.cat([_local(q).detach().reshape(-1) for q in ours.parameters()])
    b = torch.cat([_local(q).detach().reshape(-1) for q in other.parameters()])
    if ctx.rank == 0:
        doc = {
            "params": sum(q.numel() for q in other.parameters()),
            "times": times,
            "same_weights": bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5)),
        }
        (ctx.run_dir / "bench.json").write_text(json.dumps(doc))


def doc_model(dest: Path) -> None:
    """docs/context-api.md's mymodel.py, as written."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", (REPO / "docs" / "context-api.md").read_text(), re.S)
    (code,) = [body for lang, body in blocks if lang == "python" and body.startswith("# mymodel.py")]
    (dest / "mymodel.py").write_text(code)


def one_run(tmp: Path, args, *, sharded: bool = False) -> dict:
    import yaml

    spec = {
        "name": "bench-user-entry",
        "site": "local",
        "tasks_per_node": 2,
        "parallel": {"dp_shard": 2 if sharded else 1},
        "environment": {"PYTHONPATH": f"{tmp}:{Path(__file__).resolve().parent}"},
        "checkpoint": {"every_steps": 0},
        "train": {
            "entry": "user_entry:bench_entry",
            "params": {
                "steps": args.steps,
                "batch": args.batch,
                "dim": args.dim,
                "layers": args.layers,
                "heads": 8,
                "sharded": sharded,
            },
        },
    }
    run = tmp / f"run-{time.monotonic_ns()}"
    (tmp / "job.yaml").write_text(yaml.safe_dump(spec))
    out = subprocess.run(
        ["hpcscale", "run", str(tmp / "job.yaml"), "--local", "--run-dir", str(run)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        sys.exit(f"hpcscale run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    doc = json.loads((run / "bench.json").read_text())
    med = {kind: statistics.median(t) for kind, t in doc["times"].items()}
    out = {
        "params": doc["params"],
        "same_weights": doc["same_weights"],
        **{f"{kind}_step_s": round(v, 4) for kind, v in med.items()},
    }
    if sharded:
        return out | {"ratio": round(med["hpcscale"] / med["fully_shard"], 3)}
    return out | {
        "ratio": round(med["hpcscale"] / med["ddp"], 3),
        "per_parameter_ratio": round(med["per_parameter"] / med["ddp"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per setup and repetition")
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        doc_model(tmp)
        runs, sharded = [], []
        for _ in range(args.repeat):
            runs.append(one_run(tmp, args))
            sharded.append(one_run(tmp, args, sharded=True))
    met = sum(r["ratio"] <= TARGET for r in runs)
    met_sharded = sum(r["ratio"] <= TARGET for r in sharded)
    if args.json:
        doc = {"runs": runs, "sharded": sharded, "target": TARGET, "met": met, "met_sharded": met_sharded}
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"docs/context-api.md's Classifier (dim {args.dim}, {args.layers} layers, {runs[0]['params'] / 1e6:.1f} M "
        f"params), dp=2 on gloo, global batch {args.batch}; medians of {args.steps} steps per setup"
    )
    print(f"  {'run':>3} {'hpcscale ms':>12} {'DDP ms':>8} {'per-param ms':>13} {'ratio':>6} {'per-param/DDP':>14}")
    for i, r in enumerate(runs, 1):
        print(
            f"  {i:3d} {r['hpcscale_step_s'] * 1000:12.1f} {r['ddp_step_s'] * 1000:8.1f} "
            f"{r['per_parameter_step_s'] * 1000:13.1f} {r['ratio']:6.3f} {r['per_parameter_ratio']:14.3f}"
            + ("" if r["same_weights"] else "  (weights differ from DDP's!)")
        )
    print(f"target: ratio <= {TARGET}; met in {met} of {len(runs)} runs")
    print("sharded (parallel.dp_shard 2): ctx.parallelize against fully_shard by hand, same model and batch")
    print(f"  {'run':>3} {'hpcscale ms':>12} {'fully_shard ms':>15} {'ratio':>6}")
    for i, r in enumerate(sharded, 1):
        print(
            f"  {i:3d} {r['hpcscale_step_s'] * 1000:12.1f} {r['fully_shard_step_s'] * 1000:15.1f} {r['ratio']:6.3f}"
            + ("" if r["same_weights"] else "  (weights differ from fully_shard's!)")
        )
    print(f"target: ratio <= {TARGET}; met in {met_sharded} of {len(sharded)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

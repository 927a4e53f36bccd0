#!/usr/bin/env python3
"""Sharded data parallelism (parallel.dp_shard): memory per rank and step time, measured side by side in one run.

Four gloo ranks on this machine, the reference GPT (hpcscale.train.model) at --layers x --width:

- memory: a plain script (`plain_entry` below, launched by `hpcscale run --local`) that calls torch's
  `fully_shard` itself over N of the 4 ranks (N = 1: no sharding, N = 2: HSDP 2 x 2, N = 4: fully sharded)
  and reports each rank's bytes of parameters + gradients + AdamW state, counted from the local tensors
  torch holds, and its peak RSS growth from before the model was built. Target: at N = 2, 4 the state is
  at most 1.2/N of N = 1's plus one block's full parameters.
- speed: the built-in trainer at dp_shard = 4 against the plain script at N = 4 on the same model, batch and
  optimizer (AdamW, foreach off, gradient clipping at 1.0, the loss all-reduced each step as any loop logs
  it, deterministic algorithms on as the trainer's default): the ratio of median step times, target <= 1.05.
  The trainer at dp_shard = 1 (replicated) is timed too. Runs alternate (trainer, plain, replicated) in every
  repetition, so the shared machine's drift hits all.

    python scripts/bench/fsdp.py [--repeat 5] [--steps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SPEED_TARGET = 1.05
MEMORY_FACTOR = 1.2
RANKS = 4


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def plain_entry(ctx) -> None:
    """What a user writes with torch alone: fully_shard per block and at the root, AdamW, a timed loop."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpcscale.train.model import GPT, GPTShape, lm_loss

    p = ctx.params
    n = int(p["shard"])
    torch.use_deterministic_algorithms(True)  # the trainer's default numerics (train.params.deterministic)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=256, seq_len=p["seq_len"], n_layer=p["layers"], n_embd=p["width"], n_head=8))
    block_bytes = sum(q.numel() * q.element_size() for q in model.layers["0"].parameters())
    if n > 1:
        mesh = (
            init_device_mesh("cpu", (RANKS,), mesh_dim_names=("shard",))
            if n == RANKS
            else init_device_mesh("cpu", (RANKS // n, n), mesh_dim_names=("replicate", "shard"))
        )
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    rows = p["batch"] // RANKS
    g = torch.Generator().manual_seed(ctx.rank)
    times = []
    for _ in range(p["steps"]):
        t0 = time.perf_counter()
        x = torch.randint(0, 256, (rows, p["seq_len"] + 1), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        if n == 1:  # replicated: average the gradients, as DDP would
            for q in model.parameters():
                dist.all_reduce(q.grad)
                q.grad /= RANKS
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        float(logged)
        times.append(time.perf_counter() - t0)

    def nbytes(t) -> int:
        return _local(t).numel() * _local(t).element_size()

    state = sum(nbytes(q) + (nbytes(q.grad) if q.grad is not None else 0) for q in model.parameters())
    state += sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    out = torch.tensor([state, peak, block_bytes], dtype=torch.float64)
    gathered = [torch.zeros_like(out) for _ in range(RANKS)]
    dist.all_gather(gathered, out)
    if ctx.rank == 0:
        doc = {
            "times": times,
            "state_bytes": [int(t[0]) for t in gathered],
            "rss_growth_bytes": [int(t[1]) for t in gathered],
            "block_bytes": int(gathered[0][2]),
        }
        (ctx.run_dir / "bench.json").write_text(json.dumps(doc))


def _run(tmp: Path, spec: dict) -> Path:
    import yaml

    run = tmp / f"run-{time.monotonic_ns()}"
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    out = subprocess.run(
        ["hpcscale", "run", str(job), "--local", "--run-dir", str(run)], capture_output=True, text=True, timeout=1200
    )
    if out.returncode != 0:
        sys.exit(f"hpcscale run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return run


def _base(args, name: str, dp_shard: int = 1) -> dict:
    return {
        "name": name,
        "site": "local",
        "tasks_per_node": RANKS,
        "parallel": {"dp_shard": dp_shard},
        "checkpoint": {"every_steps": 0},
        "timeout_seconds": 600,
        "hang_timeout_seconds": 500,
    }


def plain(tmp: Path, args, shard: int) -> dict:
    spec = _base(args, f"plain-{shard}") | {
        "environment": {"PYTHONPATH": str(Path(__file__).resolve().parent)},
        "train": {
            "entry": "fsdp:plain_entry",
            "params": {
                "shard": shard,
                "steps": args.steps,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "layers": args.layers,
                "width": args.width,
            },
        },
    }
    return json.loads((_run(tmp, spec) / "bench.json").read_text())


def trainer(tmp: Path, args, dp_shard: int) -> list[float]:
    spec = _base(args, f"trainer-{dp_shard}", dp_shard) | {
        "train": {
            "entry": "builtin",
            "params": {
                "steps": args.steps,
                "global_batch": args.batch,
                "micro_batch": args.batch // RANKS,
                "seq_len": args.seq_len,
                "n_layer": args.layers,
                "n_embd": args.width,
                "n_head": 8,
                "eval_every": 0,
                "log_every": 1000,
            },
        }
    }
    run = _run(tmp, spec)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r]


def _steady(times: list[float]) -> float:
    return statistics.median(times[min(5, len(times) // 3) :])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        memory = {n: plain(tmp, args, n) for n in (1, 2, 4)}
        runs = []
        for _ in range(args.repeat):
            t_sharded = _steady(trainer(tmp, args, 4))
            t_plain = _steady(plain(tmp, args, 4)["times"])
            t_replicated = _steady(trainer(tmp, args, 1))
            runs.append(
                {
                    "trainer_dp_shard4_s": round(t_sharded, 4),
                    "plain_fully_shard4_s": round(t_plain, 4),
                    "trainer_replicated_s": round(t_replicated, 4),
                    "ratio_vs_plain": round(t_sharded / t_plain, 3),
                    "ratio_vs_replicated": round(t_sharded / t_replicated, 3),
                }
            )
    whole = max(memory[1]["state_bytes"])
    block = memory[1]["block_bytes"]
    mem = {
        n: {
            "state_bytes_max": max(m["state_bytes"]),
            "fraction_of_replicated": round(max(m["state_bytes"]) / whole, 4),
            "bound_bytes": int(MEMORY_FACTOR * whole / n + block) if n > 1 else whole,
            "rss_growth_mib_max": round(max(m["rss_growth_bytes"]) / 2**20, 1),
        }
        for n, m in memory.items()
    }
    met = sum(r["ratio_vs_plain"] <= SPEED_TARGET for r in runs)
    mem_ok = all(v["state_bytes_max"] <= v["bound_bytes"] for v in mem.values())
    if args.json:
        print(json.dumps({"memory": mem, "runs": runs, "speed_target": SPEED_TARGET, "met": met, "memory_ok": mem_ok}))
        return 0
    print(
        f"GPT {args.layers} x {args.width} ({whole / 16 / 1e6:.1f} M params), {RANKS} gloo ranks, global batch "
        f"{args.batch} x {args.seq_len}; medians of steps after the first 5 of {args.steps}"
    )
    print("memory per rank (parameters + gradients + AdamW state, torch's local tensors; peak RSS growth):")
    for n, v in mem.items():
        what = {1: "replicated", 2: "HSDP 2 x 2", 4: "fully sharded"}[n]
        print(
            f"  dp_shard {n} ({what:13s}) {v['state_bytes_max'] / 2**20:8.1f} MiB = {v['fraction_of_replicated']:.3f} "
            f"of replicated (bound {v['bound_bytes'] / 2**20:.1f} MiB)   RSS +{v['rss_growth_mib_max']:.0f} MiB"
        )
    print(f"  within the bound (1.2/N of replicated + one block): {'yes' if mem_ok else 'NO'}")
    head = f"{'trainer dp_shard4 ms':>21} {'plain fully_shard ms':>21} {'ratio':>6} {'replicated ms':>14}"
    head += f" {'vs repl':>8}"
    print(f"  {'run':>3} {head}")
    for i, r in enumerate(runs, 1):
        print(
            f"  {i:3d} {r['trainer_dp_shard4_s'] * 1000:21.1f} {r['plain_fully_shard4_s'] * 1000:21.1f} "
            f"{r['ratio_vs_plain']:6.3f} {r['trainer_replicated_s'] * 1000:14.1f} {r['ratio_vs_replicated']:8.3f}"
        )
    print(f"target: trainer / plain <= {SPEED_TARGET}; met in {met} of {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

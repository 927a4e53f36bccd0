#!/usr/bin/env python3
"""Data-parallel training step: hpcscale's gradient sync against torch DDP on the same model, in one run.

Part 1 (mpirun -n 2, dp=2, gloo): both ranks build the same GPT twice, once wrapped in DistributedDataParallel
and once with hpcscale.parallel.grad_sync.GradSync, and time full steps (forward, backward with overlapped
all-reduce, optimizer) in alternating blocks, so the shared machine's drift hits both alike.
Part 2: tokens/s of the reference trainer at the 3D layouts through `hpcscale run --local`, and the time from
launch to the first step for 8 ranks.

    python scripts/bench/dp_step.py [--steps 30] [--json]
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

from _workers import mpirun_workers

REPO = Path(__file__).resolve().parents[2]
TARGET = 1.05
BENCH_MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 8, "seq_len": 128}


def worker(steps: int, blocks: int, batch: int) -> None:
    """One dp rank: time DDP and GradSync steps on identical models."""
    import torch
    import torch.distributed as dist

    from hpcscale.launch.bootstrap import bootstrap
    from hpcscale.parallel.grad_sync import GradSync
    from hpcscale.train.model import GPT, GPTShape, lm_loss

    info = bootstrap(timeout_s=120, order_nodes=lambda nodes: nodes)
    torch.set_num_threads(1)
    shape = GPTShape(vocab_size=256, **BENCH_MODEL)
    g = torch.Generator().manual_seed(info.rank)
    x = torch.randint(0, 256, (batch, shape.seq_len), generator=g)
    y = torch.randint(0, 256, (batch, shape.seq_len), generator=g)

    def make(kind: str):
        torch.manual_seed(0)
        model = GPT(shape)
        if kind == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            return wrapped, None, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        return model, GradSync(model, dist.group.WORLD), torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    setups = {kind: make(kind) for kind in ("ddp", "hpcscale")}
    times: dict[str, list[float]] = {kind: [] for kind in setups}
    params = sum(p.numel() for p in setups["ddp"][0].parameters())

    def step(kind: str) -> float:
        model, sync, opt = setups[kind]
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if sync is not None:
            sync.begin(1)
        lm_loss(model(x), y).backward()
        if sync is not None:
            sync.finish()
        opt.step()
        return time.perf_counter() - t

    for kind in setups:  # warm-up
        step(kind)
        step(kind)
    for _ in range(blocks):
        for kind in setups:
            times[kind] += [step(kind) for _ in range(steps // blocks)]
    # the two must compute the same thing: compare a parameter after identical steps
    a = next(setups["ddp"][0].module.parameters())
    b = next(setups["hpcscale"][0].parameters())
    same = bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    if info.rank == 0:
        print(
            json.dumps(
                {
                    "params": params,
                    "batch_per_rank": batch,
                    "same_weights": same,
                    "ddp_s": times["ddp"],
                    "hpcscale_s": times["hpcscale"],
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def part1(steps: int) -> dict:
    out = mpirun_workers(__file__, 2, "--steps", str(steps), timeout=900)
    if out.returncode != 0:
        sys.exit(f"dp_step worker failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    doc = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    ddp, ours = statistics.median(doc["ddp_s"]), statistics.median(doc["hpcscale_s"])
    return {
        "model_params": doc["params"],
        "batch_per_rank": doc["batch_per_rank"],
        "dp": 2,
        "ddp_step_s": round(ddp, 4),
        "hpcscale_step_s": round(ours, 4),
        "ratio": round(ours / ddp, 3),
        "same_weights_after_steps": doc["same_weights"],
        "target": TARGET,
        "target_met": ours / ddp <= TARGET,
    }


def part2(steps: int) -> list[dict]:
    import yaml

    rows = []
    for tp, pp, ranks in [(1, 1, 8), (2, 1, 8), (1, 2, 8), (2, 2, 8), (2, 2, 4)]:
        with tempfile.TemporaryDirectory() as d:
            spec = {
                "name": "bench",
                "site": "local",
                "tasks_per_node": ranks,
                "parallel": {"tp": tp, "pp": pp},
                "train": {
                    "params": {
                        "steps": steps,
                        "global_batch": 16,
                        "micro_batch": 2,
                        "eval_every": 0,
                        "log_every": 1000,
                        "seq_len": 64,
                        "n_layer": 4,
                        "n_embd": 64,
                        "n_head": 4,
                    }
                },
            }
            Path(d, "job.yaml").write_text(yaml.safe_dump(spec))
            t0 = time.time()
            out = subprocess.run(
                ["hpcscale", "run", f"{d}/job.yaml", "--local", "--run-dir", f"{d}/run"],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=900,
            )
            if out.returncode != 0:
                sys.exit(f"hpcscale run failed:\n{out.stdout[-2000:]}")
            m = [json.loads(line) for line in Path(d, "run", "metrics.jsonl").read_text().splitlines()]
            m = [r for r in m if "loss" in r]
            first_step_start = m[0]["time"] - m[0]["step_time_s"]
            rows.append(
                {
                    "tp": tp,
                    "pp": pp,
                    "dp": ranks // (tp * pp),
                    "ranks": ranks,
                    "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in m[2:]), 1),
                    "comm_share": round(statistics.median(r["comm_share"] for r in m[2:]), 3),
                    "launch_to_first_step_s": round(first_step_start - t0, 2),
                }
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-layouts", action="store_true", help="only the DDP comparison")
    a = ap.parse_args()
    if a.worker:
        worker(a.steps, blocks=5, batch=8)
        return 0
    dp = part1(a.steps)
    layouts = [] if a.skip_layouts else part2(a.steps)
    if a.json:
        print(json.dumps({"dp_step": dp, "layouts": layouts}, indent=2))
    else:
        print(f"data-parallel step, GPT {BENCH_MODEL} ({dp['model_params'] / 1e6:.1f} M params), dp=2, gloo:")
        print(f"  torch DDP        {dp['ddp_step_s'] * 1000:8.1f} ms/step (median)")
        print(f"  hpcscale         {dp['hpcscale_step_s'] * 1000:8.1f} ms/step (median)")
        print(
            f"  ratio            {dp['ratio']:8.3f}  (target <= {TARGET}; same weights after the steps: "
            f"{dp['same_weights_after_steps']})"
        )
        if layouts:
            print("\nreference trainer, tiny GPT (4x64), 2 cores, oversubscribed:")
            head = ("tp", "pp", "dp", "ranks", "tokens/s", "comm share", "launch->step 0 s")
            print("  {:>3} {:>3} {:>3} {:>5} {:>10} {:>11} {:>17}".format(*head))
            for r in layouts:
                print(
                    f"  {r['tp']:3d} {r['pp']:3d} {r['dp']:3d} {r['ranks']:5d} {r['tokens_per_s']:10.1f} "
                    f"{r['comm_share']:11.3f} {r['launch_to_first_step_s']:17.2f}"
                )
    return 0 if dp["target_met"] and dp["same_weights_after_steps"] else 1


if __name__ == "__main__":
    sys.exit(main())

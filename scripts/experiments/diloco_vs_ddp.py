#!/usr/bin/env python3
"""DiLoCo across two sites against synchronous data parallel, at CPU scale, on real text.

The paper's central claim (Douillard et al. 2023, arXiv 2311.08105) shrunk to this machine: the reference GPT
at ~0.85 M parameters on hpcscale's default corpus (Python's standard library sources, byte-level), two sites,
H in {10, 50}, the same total tokens as a synchronous data-parallel run. Each site sees its own half of every
global batch (the TokenLoader's dp split: sites never see each other's samples); its inner optimizer is the
reference trainer's AdamW with warmup and cosine decay, and it persists across rounds. Every H steps each site
contributes Δ_i = θ(r−1) − θ_i, encoded as the product encodes it (hpcscale.xsite.outer: fp32 or int8), the
mean goes through the product's outer step (Nesterov SGD, η = 0.7, μ = 0.9), and both sites continue from θ(r).
The synchronous baseline trains one model on both halves each step (what DDP over the two sites computes).

Reported per configuration and seed: the final validation loss (of θ for DiLoCo), and the bytes each site
sent: DDP sends its fp32 gradient every step (4P bytes; an all-reduce moves about that much per site each
way), DiLoCo one contribution per round, counted as the size of the payload file the product writes for it
(hpcscale.xsite.roundfile.pack_payload: safetensors, zstd-compressed by default; the larger of the two
sites' each round). Output: a JSON of the figures and two PNG plots (validation loss against
tokens and against bytes sent), under --out.

    python scripts/experiments/diloco_vs_ddp.py [--steps 2000] [--seeds 3] [--out docs/experiments] [--jobs 2]
        [--outer 10:0.7:0.5,50:0.7:0.7] [--overlap 50:10] [--sync-warmup 200] [--no-sync] [--compression zstd]
        [--shared-start 500] [--lr 3e-3] [--wd 0.1] [--match-wd] [--mu-ramp 10:0.5]

--outer sets the outer step per H (η, μ; the paper's 0.7, 0.9 was tuned for H = 500 over ~180 rounds; with
40-200 rounds a shorter momentum horizon does better here: docs/cross-site.md has the sweep). --overlap H:D adds,
for that H, the overlapped variant: θ(r) lands D steps after the boundary and is adopted on top of the steps taken
meanwhile (hpcscale.launch.site_rounds). --sync-warmup W trains W synchronous steps first (their gradients count as
bytes sent). --shared-start W is the paper's protocol: every run, the synchronous one too, starts from the
synchronous run's weights and optimizer state at step W (what `xsite.start_from` gives the sites), and bytes are
counted from W on, for every run.

Needs matplotlib (pip install matplotlib). Runs configurations in --jobs processes (single-threaded torch each).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "seq_len": 128}
SITE_BATCH = 8  # sequences per site per step; the synchronous run's batch is twice this
LR, WARMUP, WD = 3e-3, 100, 0.1  # peak learning rate (--lr), warmup steps, weight decay; the floor is LR / 10
EVAL_BATCHES = 16


def lr_at(step: int, steps: int, peak: float = LR) -> float:
    if step < WARMUP:
        return peak * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return peak / 10 + 0.5 * (peak - peak / 10) * (1 + math.cos(math.pi * min(1.0, progress)))


def run_config(
    kind: str,
    H: int,
    encoding: str,
    seed: int,
    steps: int,
    eval_every: int,
    manifest: str,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    sync_warmup: int = 0,
    delay: int = 0,
    compression: str = "zstd",
    lr: float = LR,
    mu_ramp: int = 0,
    mu_start: float = 0.0,
    wd: float = WD,
    shared_start: int = 0,
) -> dict:
    import numpy as np
    import torch

    from hpcscale.data.loader import TokenLoader
    from hpcscale.train.model import GPT, GPTShape, lm_loss
    from hpcscale.xsite.outer import OuterStep, aggregate, decode, delta, encode, shapes_of
    from hpcscale.xsite.roundfile import pack_payload

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    shape = GPTShape(vocab_size=256, **MODEL)
    base = GPT(shape)
    params = sum(p.numel() for p in base.parameters())
    loaders = [
        TokenLoader(
            Path(manifest),
            seq_len=shape.seq_len,
            global_batch=2 * SITE_BATCH,
            dp_rank=i,
            dp_size=2,
            seed=seed,
            val_fraction=0.05,
        )
        for i in range(2)
    ]
    val = loaders[0].val_batches(EVAL_BATCHES)

    def evaluate(model) -> float:
        model.eval()
        with torch.no_grad():
            losses = [float(lm_loss(model(torch.from_numpy(x)), torch.from_numpy(y))) for x, y in val]
        model.train()
        return sum(losses) / len(losses)

    def opt_for(model):
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=wd)

    curve = []
    sent = 0  # bytes one site sent
    sent_uncompressed = 0  # the same, with each payload file uncompressed (compression: none)
    tokens_per_step = 2 * SITE_BATCH * shape.seq_len  # both sites together
    t0 = time.perf_counter()
    if kind == "ddp":
        model, opt = base, opt_for(base)
        for step in range(steps):
            xs, ys = zip(*(loader.next_batch() for loader in loaders), strict=True)
            x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr)
            opt.zero_grad(set_to_none=True)
            lm_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step >= shared_start:  # the shared start's exchanges are not this comparison's
                sent += 4 * params
            if (step + 1) % eval_every == 0 or step == steps - 1:
                curve.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step, "bytes": sent,
                              "val_loss": evaluate(model)})  # fmt: skip
    else:
        import copy

        theta = {n: p.detach().clone().float() for n, p in base.named_parameters()}
        outer = OuterStep(theta, lr=outer_lr, momentum=outer_momentum)
        sites = [copy.deepcopy(base) for _ in range(2)]
        opts = [opt_for(m) for m in sites]
        shapes = shapes_of(theta)
        evaluator = copy.deepcopy(base)
        global_theta = theta
        pending: tuple[int, list[dict]] | None = None  # overlap: (adopt at step, each site's boundary weights)
        for step in range(steps):
            warm = step < sync_warmup  # synchronous warm-up: gradients averaged every step, as DDP does
            for model, opt, loader in zip(sites, opts, loaders, strict=True):
                x, y = (torch.from_numpy(a) for a in loader.next_batch())
                for g in opt.param_groups:
                    g["lr"] = lr_at(step, steps, lr)
                opt.zero_grad(set_to_none=True)
                lm_loss(model(x), y).backward()
            if warm:
                with torch.no_grad():
                    for ps in zip(*(m.parameters() for m in sites), strict=True):
                        mean = sum(p.grad for p in ps) / len(ps)
                        for p in ps:
                            p.grad.copy_(mean)
                if step >= shared_start:
                    sent += 4 * params
                    sent_uncompressed += 4 * params
            for model, opt in zip(sites, opts, strict=True):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            if warm:
                if step + 1 == sync_warmup:  # round 0 starts from the warmed-up weights
                    global_theta = {n: p.detach().clone().float() for n, p in sites[0].named_parameters()}
                    outer = OuterStep(global_theta, lr=outer_lr, momentum=outer_momentum)
            elif (step + 1 - sync_warmup) % H == 0 or step == steps - 1:
                deltas, sizes = [], []
                for model in sites:
                    local = {n: p.detach() for n, p in model.named_parameters()}
                    encoded = encode(delta(global_theta, local), encoding)
                    payload, raw = pack_payload(encoded, compression)
                    sizes.append((len(payload), raw))  # the payload file as written, and its safetensors bytes
                    deltas.append((1.0, decode(encoded, encoding, shapes)))
                sent += max(n for n, _ in sizes)  # each site sends one contribution per round; count the larger
                sent_uncompressed += max(raw for _, raw in sizes)
                if mu_ramp:  # μ rises linearly from mu_start to outer_momentum over the first mu_ramp rounds
                    done = (step + 1 - sync_warmup - 1) // H  # rounds applied before this one
                    mu = mu_start + (outer_momentum - mu_start) * min(1.0, done / mu_ramp)
                    outer._optimizer.param_groups[0]["momentum"] = mu
                outer.apply(aggregate(deltas, rule="mean"))
                global_theta = outer.state().theta
                if delay:  # adopt: overlap: θ(r) lands `delay` steps later; the steps taken meanwhile are kept
                    snaps = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in sites]
                    pending = (step + 1 + delay, snaps)
                else:
                    with torch.no_grad():
                        for model in sites:
                            for n, p in model.named_parameters():
                                p.copy_(global_theta[n])
            if pending is not None and step + 1 == pending[0]:
                with torch.no_grad():
                    for model, snap in zip(sites, pending[1], strict=True):
                        for n, p in model.named_parameters():
                            p.copy_(global_theta[n] + (p - snap[n]))
                pending = None
            if (step + 1) % eval_every == 0 or step == steps - 1:
                with torch.no_grad():  # the global weights of the newest round (in warm-up: the shared weights)
                    current = dict(sites[0].named_parameters()) if warm else global_theta
                    for n, p in evaluator.named_parameters():
                        p.copy_(current[n])
                curve.append({"step": step + 1, "tokens": (step + 1) * tokens_per_step, "bytes": sent,
                              "val_loss": evaluate(evaluator)})  # fmt: skip
    return {
        "kind": kind,
        "H": H,
        "encoding": encoding,
        "outer_lr": outer_lr,
        "outer_momentum": outer_momentum,
        "sync_warmup": sync_warmup,
        "delay": delay,
        "seed": seed,
        "params": params,
        "final_val_loss": curve[-1]["val_loss"],
        "compression": compression,
        "lr": lr,
        "mu_ramp": mu_ramp,
        "mu_start": mu_start,
        "wd": wd,
        "shared_start": shared_start,
        "bytes_sent_per_site": sent,
        "bytes_sent_per_site_uncompressed": sent_uncompressed if kind != "ddp" else sent,
        "seconds": round(time.perf_counter() - t0, 1),
        "curve": curve,
    }


def label(r: dict) -> str:
    if r["kind"] == "ddp":
        return "synchronous DP"
    out = f"DiLoCo H={r['H']} {r['encoding']} η={r['outer_lr']:g} μ={r['outer_momentum']:g}"
    if r.get("shared_start"):
        out += f" from step {r['shared_start']}"
    elif r.get("sync_warmup"):
        out += f" +{r['sync_warmup']} sync steps"
    if r.get("delay"):
        out += f" overlap {r['delay']}"
    if r.get("wd", WD) != WD:
        out += f" wd={r['wd']:.3g}"
    if r.get("mu_ramp"):
        out += f" (μ from {r['mu_start']:g} over {r['mu_ramp']} rounds)"
    return out


def parse_outer(text: str) -> dict[int, tuple[float, float]]:
    """'10:0.7:0.5,50:0.7:0.7' -> {H: (η, μ)}; '' -> {} (the synchronous baseline alone)"""
    out = {}
    for part in filter(None, text.split(",")):
        h, lr, mu = part.split(":")
        out[int(h)] = (float(lr), float(mu))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--outer", default="10:0.7:0.5,50:0.7:0.7",
                    help="H:η:μ for each H (the outer Nesterov step; the paper's is 0.7:0.9)")  # fmt: skip
    ap.add_argument("--encodings", default="fp32,int8")
    ap.add_argument("--overlap", default="",
                    help="H:D,...: also run H in fp32 with adopt: overlap, θ(r) landing D steps late")  # fmt: skip
    ap.add_argument("--sync-warmup", type=int, default=0,
                    help="synchronous steps before round 0 (their gradients count as bytes sent)")  # fmt: skip
    ap.add_argument("--shared-start", type=int, default=0,
                    help="the paper's protocol: every run starts from one checkpoint, the synchronous run's weights "
                         "at this step; bytes are counted from there on, for every run")  # fmt: skip
    ap.add_argument("--no-sync", action="store_true", help="skip the synchronous baseline (exploration only)")
    ap.add_argument("--mu-ramp", default="",
                    help="R:μ0: the outer momentum rises from μ0 to --outer's μ over the first R rounds")  # fmt: skip
    ap.add_argument("--wd", type=float, default=WD, help="the inner AdamW's weight decay, for every run")
    ap.add_argument("--match-wd", action="store_true",
                    help="DiLoCo runs decay by wd·(1−μ)/η: the outer step amplifies every steady part "
                         "of Δ (weight decay is one) by η/(1−μ); so they decay as the synchronous run")  # fmt: skip
    ap.add_argument("--lr", type=float, default=LR, help="peak inner learning rate, for every run (AdamW)")
    ap.add_argument("--compression", default="zstd", choices=["zstd", "none"],
                    help="how contributions are stored and sent (the cross-site config's compression)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "experiments")
    a = ap.parse_args()
    from hpcscale.data.prepare import default_corpus_dataset

    scratch = Path("/tmp/hpcscale-experiments")
    scratch.mkdir(exist_ok=True)
    manifest = str(default_corpus_dataset(scratch, sample_len=MODEL["seq_len"] + 1))
    outer = parse_outer(a.outer)
    configs = [] if a.no_sync else [("ddp", 1, "fp32", 0.0, 0.0, 0, 0)]
    for h, (lr, mu) in outer.items():
        configs += [("diloco", h, e, lr, mu, a.shared_start or a.sync_warmup, 0) for e in a.encodings.split(",")]
    for part in filter(None, a.overlap.split(",")):
        h, d = (int(x) for x in part.split(":"))
        lr, mu = outer[h]
        configs.append(("diloco", h, "fp32", lr, mu, a.shared_start or a.sync_warmup, d))
    ramp, mu0 = (int(a.mu_ramp.split(":")[0]), float(a.mu_ramp.split(":")[1])) if a.mu_ramp else (0, 0.0)
    jobs = [(k, h, e, seed, a.steps, a.eval_every, manifest, lr, mu, wu, d, a.compression, a.lr, ramp, mu0,
             a.wd * (1 - mu) / lr if a.match_wd and k == "diloco" else a.wd, a.shared_start)
            for seed in range(a.seeds) for k, h, e, lr, mu, wu, d in configs]  # fmt: skip
    with ProcessPoolExecutor(a.jobs) as pool:
        results = list(pool.map(run_config, *zip(*jobs, strict=True)))
    summary = []
    ddp = {r["seed"]: r for r in results if r["kind"] == "ddp"}
    for lab in dict.fromkeys(label(r) for r in results):
        rs = [r for r in results if label(r) == lab]
        finals = [r["final_val_loss"] for r in rs]
        row = {
            "config": lab,
            "final_val_loss_mean": round(statistics.mean(finals), 4),
            "final_val_loss_spread": round(max(finals) - min(finals), 4),
            "bytes_sent_per_site": round(statistics.mean(r["bytes_sent_per_site"] for r in rs)),
        }
        if ddp:
            rel = [r["final_val_loss"] / ddp[r["seed"]]["final_val_loss"] - 1 for r in rs]
            fewer = [ddp[r["seed"]]["bytes_sent_per_site"] / r["bytes_sent_per_site"] for r in rs]
            row.update(vs_sync_pct_mean=round(100 * statistics.mean(rel), 2),
                       vs_sync_pct_worst=round(100 * max(rel), 2),
                       fewer_bytes_than_sync=round(statistics.mean(fewer), 2),
                       fewer_bytes_than_sync_least=round(min(fewer), 2))  # fmt: skip
        summary.append(row)
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"model": MODEL, "params": results[0]["params"], "steps": a.steps, "site_batch": SITE_BATCH,
           "seeds": a.seeds, "lr": a.lr, "compression": a.compression, "summary": summary, "runs": results}  # fmt: skip
    (a.out / "diloco_vs_ddp.json").write_text(json.dumps(doc, indent=1))
    plot(results, a.out)
    print(f"GPT {MODEL} ({results[0]['params'] / 1e6:.2f} M params), 2 sites, {a.steps} steps, {a.seeds} seeds")
    print(f"{'config':44} {'val loss':>9} {'spread':>7} {'vs sync':>8} {'worst':>7} {'bytes/site':>12} {'fewer':>7}")
    for s in summary:
        print(f"{s['config']:44} {s['final_val_loss_mean']:9.4f} {s['final_val_loss_spread']:7.4f} "
              f"{s.get('vs_sync_pct_mean', float('nan')):7.2f}% {s.get('vs_sync_pct_worst', float('nan')):6.2f}% "
              f"{s['bytes_sent_per_site']:12d} {s.get('fewer_bytes_than_sync', float('nan')):7.2f}x")  # fmt: skip
    return 0


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for x, name, xlabel, log in (("tokens", "loss_vs_tokens", "tokens (both sites)", False),
                                 ("bytes", "loss_vs_bytes", "bytes sent per site", True)):  # fmt: skip
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for lab in dict.fromkeys(label(r) for r in results):
            rs = [r for r in results if label(r) == lab]
            # on the bytes axis (log), only what follows the first byte sent (--shared-start: none before it)
            keep = [i for i, p in enumerate(rs[0]["curve"]) if not log or p[x] > 0]
            steps = [rs[0]["curve"][i][x] for i in keep]
            mean = [statistics.mean(r["curve"][i]["val_loss"] for r in rs) for i in keep]
            lo = [min(r["curve"][i]["val_loss"] for r in rs) for i in keep]
            hi = [max(r["curve"][i]["val_loss"] for r in rs) for i in keep]
            (line,) = ax.plot(steps, mean, label=lab)
            ax.fill_between(steps, lo, hi, alpha=0.2, color=line.get_color())
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        title = "DiLoCo across 2 sites vs synchronous data parallel (band: seeds' range)"
        if results[0].get("shared_start"):
            title += f"\nevery run from one checkpoint at step {results[0]['shared_start']}; bytes from there on"
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

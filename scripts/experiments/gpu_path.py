"""hpcscale's CUDA/NCCL path on one GPU: real parts, world size 1 (NCCL refuses two ranks on one GPU).

    OUT=/tmp/gpu-out python3 scripts/experiments/gpu_path.py      # on a machine with a GPU; results.json in OUT

1. components: FSDP2 (bf16 mixed precision) over a CUDA device mesh, hpcscale's global-norm clip, an
   asynchronous checkpoint with deferred staging taken from GPU memory while the next forward and backward
   run, then a fresh model loaded from it: every tensor bitwise the saved one, the CUDA RNG restored.
2. launch: `hpcscale run --local -n 1` of the built-in trainer on cuda with bf16 and async checkpoints (when
   mpirun exists there): stopped with SIGTERM mid-run, resumed with --reuse, its losses against an
   uninterrupted run, bitwise.
3. node-local tier: the same, with `checkpoint.local` saving to a node-local directory every 3 steps and the
   shared tier every 10, the rank killed with SIGKILL: the resume must load from the node-local tier (its log
   line says so) and the losses must again be bitwise.
4. ckpt_gpu: a 1 GiB state held on the GPU saved (synchronously, and asynchronously: what the loop waits for)
   against a raw O_DIRECT write of the same bytes from host memory, and a verified load back into GPU memory
   against a cold raw read, five repetitions side by side.
5. ckpt_sharded: scripts/bench/ckpt_sharded.py as it is (8 CPU ranks over gloo) on this machine's disk.
6. ledger_gpu: two ranks on gloo, each with a model on the GPU, all-reduce from gradient hooks during backward:
   the communication ledger counts them although torch's autograd engine runs them on its device thread.

    DEVICE=cpu python3 scripts/experiments/gpu_path.py   # parts 2 and 3 on the CPU: a dry run of the script
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(os.environ.get("OUT", "/tmp/gpu-out"))
OUT.mkdir(parents=True, exist_ok=True)
results: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    results["gpu"] = torch.cuda.get_device_name(0)


def record(name, fn):
    t = time.perf_counter()
    try:
        got = fn()
        results[name] = {"ok": True, "s": round(time.perf_counter() - t, 2), **(got or {})}
    except Exception as e:
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "tb": traceback.format_exc()[-4000:]}
    print(name, json.dumps(results[name])[:3000], flush=True)


def local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def components():
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims
    from hpcscale.parallel.clip import clip_grad_norm
    from hpcscale.parallel.fsdp import mixed_precision_policy, reshard
    from hpcscale.train.model import GPT, GPTShape, lm_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29551", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp_shard",))

    def build():
        torch.manual_seed(0)
        m = GPT(GPTShape(vocab_size=256, seq_len=256, n_layer=6, n_embd=512, n_head=8)).to(dev)
        for b in m.layers.values():  # as hpcscale.parallel.fsdp.shard_model does, over a 1-rank mesh
            fully_shard(b, mesh=mesh, mp_policy=mixed_precision_policy("bf16", dev))
        fully_shard(m, mesh=mesh, mp_policy=mixed_precision_policy("bf16", dev, root=True))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)

    def tensors(m, opt):
        reshard(m)
        msd, osd = get_state_dict(m, [opt])
        out = {f"model/{k}": v for k, v in msd.items() if torch.is_tensor(v)}
        for fqn, s in osd["state"].items():
            for k, v in s.items():
                if torch.is_tensor(v):
                    out[f"optim/{fqn}/{k}"] = v
        return out

    m, opt = build()
    g = torch.Generator(device=dev).manual_seed(1)
    data = torch.randint(0, 256, (16, 257), device=dev, generator=g)
    norms = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(m(data[:, :-1]), data[:, 1:])
        loss.backward()
        norms.append(float(clip_grad_norm(list(m.parameters()), 1.0, pp_group=None, device=dev)))
        return loss

    for _ in range(3):
        step()
        opt.step()
    root = Path(tempfile.mkdtemp(dir=os.environ.get("TMPDIR", "/tmp")))
    dims = ParallelDims(tp=1, pp=1, dp=1)
    mgr = CheckpointManager(root, dims=dims, rank=0, device=dev, log=print)
    state = tensors(m, opt)
    devices = sorted({str(local(v).device) for v in state.values()})
    dtypes = sorted({str(local(v).dtype) for v in state.values()})
    rng_before = torch.cuda.get_rng_state(dev).clone()
    mgr.save(3, state, {"step": 3}, asynchronous=True, defer_staging=True)
    ref = {k: local(v).detach().clone() for k, v in state.items()}  # on the main stream, after the save call
    loss = step()  # forward and backward overlap the background copy
    mgr.wait_staged()
    opt.step()  # changes every saved tensor: the checkpoint must hold the values before it
    mgr.wait()
    torch.randn(10, device=dev)  # move the CUDA RNG on
    m2, opt2 = build()
    state2 = tensors(m2, opt2)
    mgr2 = CheckpointManager(root, dims=dims, rank=0, device=dev, log=print)
    restored = mgr2.load_latest(state2)
    assert restored is not None and restored.step == 3, restored
    bad = [k for k, v in state2.items() if not torch.equal(local(v), ref[k])]
    from hpcscale.ckpt.rng import restore_rng

    restore_rng(restored.rng, dev)
    rng_ok = torch.equal(torch.cuda.get_rng_state(dev), rng_before)
    assert not bad, f"{len(bad)} tensors differ after the load, e.g. {bad[:3]}"
    mgr.close()
    mgr2.close()
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    return {
        "tensors": len(state2),
        "devices": devices,
        "dtypes": dtypes,
        "grad_norms": norms,
        "loss_after": float(loss),
        "cuda_rng_restored": rng_ok,
        "logits_dtype": str(m(data[:2, :-1]).dtype),
    }


DEVICE = os.environ.get("DEVICE", "cuda")
JOB = f"""name: gpu-check
site: SITE
nodes: 1
tasks_per_node: 1
device: {DEVICE}
train:
  entry: builtin
  params: {{steps: 30, global_batch: 16, micro_batch: 8, seq_len: 128, n_layer: 4, n_embd: 256, n_head: 4,
           bf16: {str(DEVICE == "cuda").lower()}, eval_every: 0, fused_optimizer: true}}
"""


def losses(run: Path) -> dict:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def _rank_pids(run_dir: Path) -> list[int]:
    """The `hpcscale launch --run-dir RUN_DIR` ranks running now."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launch" in argv and str(run_dir).encode() in argv:
            pids.append(int(proc.name))
    return pids


def stop_resume(tag: str, checkpoint: str, node_local: bool = False) -> dict:
    """An uninterrupted run (a) against one stopped after 12 losses (SIGTERM to `run`; node_local: SIGKILL to the
    rank) and resumed with --reuse (b)."""
    if not shutil.which("mpirun"):
        return {"skipped": "no mpirun on this machine"}
    work = Path(tempfile.mkdtemp())
    site = (Path(__file__).resolve().parents[2] / "site_configs" / "local.yaml").read_text()
    if node_local:
        site = site.replace("filesystems:\n", f"filesystems:\n  node_local: {work}/node-local\n")
    (work / "site.yaml").write_text(site)
    (work / "job.yaml").write_text(JOB.replace("SITE", str(work / "site.yaml")) + checkpoint)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = [sys.executable, "-m", "hpcscale", "run", str(work / "job.yaml"), "--local", "-n", "1"]
    a = subprocess.run([*cmd, "--run-dir", str(work / "a")], capture_output=True, text=True, env=env, timeout=240)
    (OUT / f"{tag}_a.log").write_text(a.stdout[-20000:] + a.stderr[-20000:])
    assert a.returncode == 0, a.stdout[-1000:] + a.stderr[-2000:]
    p = subprocess.Popen([*cmd, "--run-dir", str(work / "b")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)  # fmt: skip
    deadline = time.time() + 180
    while time.time() < deadline:
        mf = work / "b" / "metrics.jsonl"
        if mf.exists() and sum('"loss"' in x for x in mf.read_text().splitlines()) >= 12:
            break
        time.sleep(0.2)
    if node_local:  # a lost node: no save at the stop (SIGTERM saves to the shared tier, correctly)
        for pid in _rank_pids(work / "b"):
            os.kill(pid, signal.SIGKILL)
    else:
        p.send_signal(signal.SIGTERM)
    out_b, _ = p.communicate(timeout=120)
    rc_b = p.returncode
    c = subprocess.run([*cmd, "--run-dir", str(work / "b"), "--reuse"], capture_output=True, text=True, env=env,
                       timeout=240)  # fmt: skip
    (OUT / f"{tag}_b.log").write_text(out_b[-20000:] + "\n----- reuse -----\n" + c.stdout[-20000:] + c.stderr[-20000:])
    la, lb = losses(work / "a"), losses(work / "b")
    same = [s for s in la if s in lb and la[s] == lb[s]]
    resumed = [x for x in (c.stdout + c.stderr).splitlines() if "resumed from" in x][:1]
    staging = [x for x in (a.stdout + a.stderr).splitlines() if "pinned host memory per rank" in x][:1]
    tiers = _tiers(work, out_b + c.stdout + c.stderr) if node_local else {}
    shutil.rmtree(work, ignore_errors=True)
    return {
        "stop_rc": rc_b,
        "resume_rc": c.returncode,
        "steps_a": len(la),
        "steps_b": len(lb),
        "bitwise_equal_steps": len(same),
        "first_diff": next((s for s in sorted(la) if lb.get(s) != la[s]), None),
        "resumed_line": resumed,
        "from_node_local": bool(resumed) and "of the node-local tier" in resumed[0],
        "staging_line": staging,
        **tiers,
    }


def _tiers(work: Path, log: str) -> dict:
    """What the drains left on the shared tier: which steps were drained, whether every shared step verifies,
    and, for each step both tiers hold, whether their root digests (DIGEST) are equal."""
    import re

    drained = sorted({int(x) for x in re.findall(r"checkpoint (\d+) saved: [\d.]+ s blocking, drained", log)})
    shared = sorted((work / "b" / "checkpoints").glob("step-*"))
    verified = [
        subprocess.run([sys.executable, "-m", "hpcscale", "ckpt", "verify", str(d)], capture_output=True).returncode
        == 0
        for d in shared
    ]
    mine = work / "node-local" / f"hpcscale-{(work / 'b' / 'run-id').read_text().strip()}"  # not run a's steps
    local = {d.parent.name: d.read_text() for d in mine.glob("step-*/DIGEST")}
    both = {d.name: (d / "DIGEST").read_text() == local[d.name] for d in shared if d.name in local}
    return {"drained": drained, "shared_steps_verified": all(verified) and bool(verified), "same_digest": both}


def launch():
    return stop_resume("launch", "checkpoint: {every_steps: 5, async: true}\n")


def nodelocal():
    tiers = "checkpoint: {every_steps: 10, async: true, local: {every_steps: 3, keep_last: 20}}\n"
    return stop_resume("nodelocal", tiers, True)


def ckpt_gpu():
    """1 GiB on the GPU: save (sync; async = what the loop waits for) vs a raw O_DIRECT write of the same bytes
    from host memory; verified load into GPU memory vs a cold raw read. Five repetitions, alternating order."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from ckpt import drop_caches

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.ckpt.writer import aligned_empty
    from hpcscale.layout import ParallelDims

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29552", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", device_id=dev)
    base = Path(os.environ.get("BENCH_DIR", "/var/tmp/hpcscale-gpu-bench"))
    shutil.rmtree(base, ignore_errors=True)
    (base / "raw").mkdir(parents=True)
    g = torch.Generator(device=dev).manual_seed(0)
    state = {f"w{i:02d}": torch.randn(6400, 1024, device=dev, generator=g) for i in range(40)}  # 25 MiB each
    nbytes = sum(t.numel() * 4 for t in state.values())
    host = {k: aligned_empty(t.shape, t.dtype) for k, t in state.items()}
    dims = ParallelDims(tp=1, pp=1, dp=1)
    mgr = CheckpointManager(base / "ckpt", dims=dims, rank=0, device=dev, keep_last=100)
    mgr.save(1, state, {"step": 1}, asynchronous=False)

    def raw_write(rep):
        fd = os.open(base / "raw" / f"r{rep}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        for t in host.values():
            os.write(fd, memoryview(t.view(torch.uint8).numpy()))
        os.fsync(fd)
        os.close(fd)

    def timed(fn):
        torch.cuda.synchronize(dev)
        os.sync()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t

    save_s, raw_s, async_block_s, async_total_s = [], [], [], []
    step = 1
    for rep in range(5):
        for k, t in state.items():
            t.add_(1.0)
            host[k].copy_(t)
        order = [0, 1] if rep % 2 == 0 else [1, 0]
        for o in order:
            if o == 0:
                raw_s.append(timed(lambda rep=rep: raw_write(rep)))
            else:
                step += 1
                save_s.append(timed(lambda n=step: mgr.save(n, state, {"step": n}, asynchronous=False)))
        os.unlink(base / "raw" / f"r{rep}.bin")
    for _ in range(5):
        for t in state.values():
            t.add_(1.0)
        step += 1
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        mgr.save(step, state, {"step": step}, asynchronous=True)
        async_block_s.append(time.perf_counter() - t0)
        mgr.wait()
        async_total_s.append(time.perf_counter() - t0)
    saved = {k: t.clone() for k, t in state.items()}
    newest = base / "ckpt" / f"step-{step:08d}" / "data" / "rank-00000.bin"
    read_s, load_s, dropped = [], [], True

    def raw_read():
        fd = os.open(newest, os.O_RDONLY)
        while os.read(fd, 16 << 20):
            pass
        os.close(fd)

    fresh = {k: torch.empty_like(t) for k, t in state.items()}
    loader = CheckpointManager(base / "ckpt", dims=dims, rank=0, device=dev, keep_last=100)
    for rep in range(5):
        order = [0, 1] if rep % 2 == 0 else [1, 0]
        for o in order:
            dropped = drop_caches() and dropped
            if o == 0:
                read_s.append(timed(raw_read))
            else:
                load_s.append(timed(lambda: loader.load_latest(fresh, check_rng=False)))
    ok = all(torch.equal(fresh[k], saved[k]) for k in saved) and all(t.device == dev for t in fresh.values())
    mgr.close()
    loader.close()
    dist.destroy_process_group()
    shutil.rmtree(base, ignore_errors=True)
    r = lambda xs: [round(x, 3) for x in xs]  # noqa: E731
    return {
        "gib": nbytes / 2**30,
        "save_s": r(save_s),
        "raw_direct_write_s": r(raw_s),
        "save_vs_raw_write": r([w / s for w, s in zip(raw_s, save_s, strict=True)]),
        "async_blocking_s": r(async_block_s),
        "async_total_s": r(async_total_s),
        "load_s": r(load_s),
        "raw_read_s": r(read_s),
        "load_vs_cold_raw_read": r([rd / ld for rd, ld in zip(read_s, load_s, strict=True)]),
        "cache_dropped": dropped,
        "loaded_bitwise_on_gpu": ok,
    }


def ckpt_sharded():
    script = Path(__file__).resolve().parents[1] / "bench" / "ckpt_sharded.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks: eight ranks cannot share the one GPU
    out = subprocess.run([sys.executable, str(script), "--json"], capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stdout[-1500:] + out.stderr[-1500:]
    doc = json.loads(out.stdout[out.stdout.index("{") :])
    return {k: v for k, v in doc.items() if k != "measured"} | {"cpus": os.cpu_count()}


def save_results():
    (OUT / "results.json").write_text(json.dumps(results, indent=2))


def user_bf16():
    """parallel.mixed_precision bf16 for a model FSDP does not shard (dp_shard = 1), on the GPU: the forward under
    autocast by forward hooks (an inner Linear's output bf16), the output fp32, parameters and gradients fp32; a
    deep copy (an EMA model) and a pickled copy compute in bf16 as well; torch.compile of the model gives the
    eager outputs. The collective-wait clock (hpcscale.launch.waits) installed under NCCL: an all-reduce
    through the patched Work.wait, its result right, and a functional all-reduce inside a torch.compile'd
    function (the clock stays out of the traced graph). DEVICE=cpu: the same on gloo, a dry run."""
    import copy
    import pickle

    import torch.distributed._functional_collectives as funcol

    from hpcscale.launch.waits import install
    from hpcscale.layout import ParallelDims
    from hpcscale.parallel.fsdp import shard_model

    cuda = os.environ.get("DEVICE", "cuda") == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29553", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=dev) if cuda else dist.init_process_group("gloo")
    clock = install()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).to(dev)
    seen = []
    spy = m[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    shard_model(m, mesh=None, dims=ParallelDims(tp=1, pp=1, dp=1), device=dev, mixed_precision="bf16")
    x = torch.randn(4, 64, device=dev)
    out = m(x)
    out.sum().backward()
    ema = copy.deepcopy(m)
    ema_out = ema(x)
    spy.remove()  # a local lambda: the model pickles without it
    unpickled = pickle.loads(pickle.dumps(m))
    unpickled_out = unpickled(x)
    compiled = torch.compile(m)
    compiled_out = compiled(x)
    compiled_out.sum().backward()
    t = torch.full((4,), 2.0, device=dev)
    dist.all_reduce(t)  # through the timed Work.wait

    @torch.compile
    def reduce_twice(v):
        return funcol.all_reduce(v, "sum", dist.group.WORLD) * 2

    r = reduce_twice(torch.full((4,), 3.0, device=dev))
    if cuda:
        torch.cuda.synchronize(dev)
    return {
        "inner_dtypes": sorted({str(d) for d in seen}),
        "out_dtype": str(out.dtype),
        "param_dtype": str(m[0].weight.dtype),
        "grad_dtype": str(m[0].weight.grad.dtype),
        "ema_out_bitwise": bool(torch.equal(ema_out, out)),
        "unpickled_out_bitwise": bool(torch.equal(unpickled_out, out)),
        "compiled_out_dtype": str(compiled_out.dtype),
        "compiled_max_abs_diff": float((compiled_out - out).abs().max()),
        "all_reduce_ok": bool((t == 2.0).all()),
        "compiled_funcol_ok": bool((r == 6.0).all()),
        "waits_counted_s": round(clock.total_s, 6),
    }


def _ledger_rank(rank: int, port: int, q) -> None:
    """One of two ranks on a gloo group (NCCL refuses two ranks on one GPU; gloo does not care), each with a
    model on the device: a gradient hook all-reduces over the group during backward. On CUDA torch's autograd
    engine runs that hook on its device thread, not the training thread: the ledger must count it there."""
    import threading

    from hpcscale.launch.ledger import install

    dev = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ledger = install()
    main = threading.get_ident()
    threads = []
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dev)

    def hook(grad):
        threads.append(threading.get_ident())
        flat = grad.detach().float().cpu().contiguous()  # gloo's all-reduce takes CPU tensors
        dist.all_reduce(flat)
        return grad

    for prm in m.parameters():
        prm.register_hook(hook)
    ledger.take()
    for _ in range(2):
        m(torch.randn(8, 32, device=dev)).sum().backward()
    dist.barrier()  # on the training thread: counted as well
    traffic = ledger.take()
    q.put(
        {
            "rank": rank,
            "hook_threads_other_than_main": sum(t != main for t in threads),
            "hooks": len(threads),
            "counts": {f"{g}/{k}": v for (g, k), v in traffic.counts.items()},
        }
    )
    dist.destroy_process_group()


def ledger_gpu():
    """The communication ledger counts collectives issued in backward on torch's autograd device threads."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ledger_rank, args=(r, 29561, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((q.get(timeout=180) for _ in procs), key=lambda d: d["rank"])
    for p in procs:
        p.join(60)
    params = 4  # two Linear layers: weight and bias each
    for d in got:
        allreduce = d["counts"].get("default_pg/all_reduce", [0, 0])
        assert d["hooks"] == 2 * params, d
        assert allreduce[0] == 2 * params, (
            f"rank {d['rank']}: {allreduce[0]} of {2 * params} backward all-reduces counted: {d}"
        )
    return {"ranks": got}


parts = {
    "user_bf16": user_bf16,
    "components": components,
    "launch": launch,
    "nodelocal": nodelocal,
    "ckpt_gpu": ckpt_gpu,
    "ckpt_sharded": ckpt_sharded,
    "ledger_gpu": ledger_gpu,
}
if __name__ == "__main__":  # the ledger part's ranks import this file (spawn): they must not run the parts
    for name in os.environ.get("PARTS", ",".join(parts)).split(","):
        record(name, parts[name])
        save_results()
    shown = {
        k: ({kk: vv for kk, vv in v.items() if kk != "tb"} if isinstance(v, dict) else v) for k, v in results.items()
    }
    print(json.dumps(shown, indent=1))

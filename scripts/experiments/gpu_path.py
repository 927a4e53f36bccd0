"""hpcscale's CUDA/NCCL path on one GPU: real parts, world size 1 (NCCL refuses two ranks on one GPU).

    OUT=/tmp/gpu-out python3 scripts/experiments/gpu_path.py      # on a machine with a GPU; results.json in OUT

1. components: FSDP2 (bf16 mixed precision) over a CUDA device mesh, hpcscale's global-norm clip, an
   asynchronous checkpoint with deferred staging taken from GPU memory while the next forward and backward
   run, then a fresh model loaded from it: every tensor bitwise the saved one, the CUDA RNG restored.
2. launch: `hpcscale run --local -n 1` of the built-in trainer on cuda with bf16 and async checkpoints (when
   mpirun exists there): stopped with SIGTERM mid-run, resumed with --reuse, its losses against an
   uninterrupted run, bitwise.
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


JOB = """name: gpu-check
site: local
nodes: 1
tasks_per_node: 1
device: cuda
train:
  entry: builtin
  params: {steps: 30, global_batch: 16, micro_batch: 8, seq_len: 128, n_layer: 4, n_embd: 256, n_head: 4,
           bf16: true, eval_every: 0}
checkpoint: {every_steps: 5, async: true}
"""


def losses(run: Path) -> dict:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def launch():
    if not shutil.which("mpirun"):
        return {"skipped": "no mpirun on this machine"}
    work = Path(tempfile.mkdtemp())
    (work / "job.yaml").write_text(JOB)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = [sys.executable, "-m", "hpcscale", "run", str(work / "job.yaml"), "--local", "-n", "1"]
    a = subprocess.run([*cmd, "--run-dir", str(work / "a")], capture_output=True, text=True, env=env, timeout=240)
    (OUT / "launch_a.log").write_text(a.stdout[-20000:] + a.stderr[-20000:])
    assert a.returncode == 0, a.stderr[-2000:]
    p = subprocess.Popen([*cmd, "--run-dir", str(work / "b")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)  # fmt: skip
    deadline = time.time() + 180
    while time.time() < deadline:
        mf = work / "b" / "metrics.jsonl"
        if mf.exists() and sum('"loss"' in x for x in mf.read_text().splitlines()) >= 12:
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out_b, _ = p.communicate(timeout=120)
    rc_b = p.returncode
    c = subprocess.run([*cmd, "--run-dir", str(work / "b"), "--reuse"], capture_output=True, text=True, env=env,
                       timeout=240)  # fmt: skip
    (OUT / "launch_b.log").write_text(out_b[-20000:] + "\n----- reuse -----\n" + c.stdout[-20000:] + c.stderr[-20000:])
    la, lb = losses(work / "a"), losses(work / "b")
    same = [s for s in la if s in lb and la[s] == lb[s]]
    return {
        "stop_rc": rc_b,
        "resume_rc": c.returncode,
        "steps_a": len(la),
        "steps_b": len(lb),
        "bitwise_equal_steps": len(same),
        "first_diff": next((s for s in sorted(la) if lb.get(s) != la[s]), None),
        "resumed_line": [x for x in c.stdout.splitlines() if "resumed from" in x][:1],
    }


record("components", components)
record("launch", launch)
(OUT / "results.json").write_text(json.dumps(results, indent=2))
shown = {k: ({kk: vv for kk, vv in v.items() if kk != "tb"} if isinstance(v, dict) else v) for k, v in results.items()}
print(json.dumps(shown, indent=1))

"""GradSync all-reduces its buckets in one order on every rank, whatever parameters a rank left unused, and
averages with foreach kernels; clip_grad_norm clips with them and leaves the norm on the device.

Two real gloo ranks (processes) train a stack of equal-sized layers, one bucket per layer, where each rank skips
a different layer: a bucket filled during backward on one rank is left for finish() on the other. Were the
buckets launched in the order they filled, the ranks would pair one layer's bucket with another's (same size:
no error, wrong sums). The ranks record the order they launch buckets in and the aten ops their step runs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

RANK = r"""
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from hpcscale.parallel.grad_sync import GradSync

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
torch.manual_seed(0)
layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(4))  # buckets: 0 is layers[3] ... 3 is layers[0]
reference = [l.weight.detach().clone() for l in layers]
sync = GradSync(layers, dist.group.WORLD, bucket_mb=1e-6, automatic=True)  # one bucket per layer
assert len(sync.buckets) == 4
order = []
launch = sync._launch
index = {id(b): i for i, b in enumerate(sync.buckets)}
sync._launch = lambda bucket: (order.append(index[id(bucket)]), launch(bucket))[1]

def forward(weights, x, skip):
    for i, w in enumerate(weights):
        if i not in skip:
            x = torch.tanh(x @ w.T)
    return x.sum()

def local_grads(x, skip):
    # this rank's own gradient of each layer, zeros for those it skips: what GradSync averages
    ws = [w.clone().requires_grad_() for w in reference]
    forward(ws, x, skip).backward()
    return [w.grad if w.grad is not None else torch.zeros_like(w) for w in ws]

out = {"steps": []}
skips = [({1}, {2}), ({2}, set()), (set(), {0, 3}), (set(), set())]  # (rank 0's, rank 1's) unused layers
for step, by_rank in enumerate(skips):
    skip = by_rank[rank]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    want_local = local_grads(x, skip)
    layers.zero_grad(set_to_none=True)
    order.clear()
    forward([l.weight for l in layers], x, skip).backward()  # finish() runs at the end of backward
    got = [l.weight.grad.clone() for l in layers]
    both = [[torch.zeros_like(g) for _ in range(2)] for g in want_local]
    for g, gathered in zip(want_local, both):
        dist.all_gather(gathered, g)
    want = [(a + b) / 2 for a, b in both]
    theirs = [[torch.zeros_like(g) for _ in range(2)] for g in got]
    for g, gathered in zip(got, theirs):
        dist.all_gather(gathered, g)
    out["steps"].append({
        "order": list(order),
        "correct": all(torch.equal(g, w) for g, w in zip(got, want)),
        "ranks_agree": all(torch.equal(a, b) for a, b in theirs),
    })

# one bucket of many parameters, counted mode: the aten ops of a step's backward and finish()
many = nn.Sequential(*(nn.Linear(4, 4) for _ in range(8)))
counted = GradSync(many, dist.group.WORLD)
assert len(counted.buckets) == 1
counted.begin(1)
with Ops() as ops:
    many(torch.randn(2, 4)).sum().backward()
    counted.finish()
out["ops"] = ops.names
out["params"] = len(list(many.parameters()))
dist.barrier()
dist.destroy_process_group()
os.write(1, (json.dumps(out) + "\n").encode())
os._exit(0)  # no interpreter teardown, where a gloo thread outliving the group aborts it (as hpcscale launch exits)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    rendezvous = tmp_path_factory.mktemp("grad-sync-order") / "rendezvous"  # a file: no port to take first
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rendezvous), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def test_buckets_are_launched_in_index_order_on_every_rank_whatever_is_unused(ranks):
    for rank, result in enumerate(ranks):
        for step, s in enumerate(result["steps"]):
            assert s["order"] == [0, 1, 2, 3], (rank, step, s["order"])


def test_every_rank_gets_the_average_with_unused_parameters_counted_as_zero(ranks):
    for rank, result in enumerate(ranks):
        for step, s in enumerate(result["steps"]):
            assert s["correct"] and s["ranks_agree"], (rank, step, s)


def test_packing_averaging_and_writing_back_are_foreach_kernels(ranks):
    for result in ranks:
        ops = result["ops"]
        # per parameter: one copy into the bucket, one back; as foreach kernels: one each for the whole bucket
        assert "copy_" not in ops and "div_" not in ops, sorted(set(ops))
        assert ops.count("_foreach_copy_") == 2 and ops.count("_foreach_div_") == 1, sorted(set(ops))
        assert "_local_scalar_dense" not in ops  # no value read back to the host


# ---- clipping ---------------------------------------------------------------------------------------------


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _params(shapes: list[tuple[int, ...]], seed: int, scale: float) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


def _loop_clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """The per-tensor definition (one process, no mesh): fp32 norms, squared and added in fp64 in parameter
    order, the scale applied where the norm exceeds max_norm."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        total += torch.linalg.vector_norm(p.grad, 2, dtype=torch.float32).double().square()
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def test_clipping_runs_foreach_kernels_and_leaves_the_norm_on_the_device():
    from hpcscale.parallel.clip import clip_grad_norm

    params = _params([(5, 3)] * 20 + [(7,)] * 20, seed=1, scale=3.0)
    with _Ops() as ops:
        norm = clip_grad_norm(params, 1.0, pp_group=None, device=torch.device("cpu"))
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.device.type == "cpu"
    assert "_local_scalar_dense" not in ops.names  # no .item(), float() or bool() of a tensor: no host sync
    assert ops.names.count("_foreach_norm") == 1 and ops.names.count("_foreach_mul_") == 1, ops.names
    assert "linalg_vector_norm" not in ops.names and "mul_" not in ops.names, ops.names


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), min_size=1, max_size=40),
    st.integers(0, 2**31),
    st.sampled_from([1e-3, 0.5, 1.0, 30.0]),
    st.sampled_from([0.0, 0.5, 1.0, 5.0, float("inf")]),
)
def test_clipping_gives_the_per_tensor_definitions_bits(shapes, seed, scale, max_norm):
    from hpcscale.parallel.clip import clip_grad_norm

    params, ours = _params(shapes, seed, scale), _params(shapes, seed, scale)
    want = _loop_clip(params, max_norm)
    got = clip_grad_norm(ours, max_norm, pp_group=None, device=torch.device("cpu"))
    assert float(got) == want
    for a, b in zip(ours, params, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_norm_just_under_max_norm_is_not_clipped():
    from hpcscale.parallel.clip import clip_grad_norm

    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([1.0 - 2e-7])
    clip_grad_norm([p], 1.0, pp_group=None)
    assert torch.equal(p.grad, torch.tensor([1.0 - 2e-7]))

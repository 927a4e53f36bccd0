"""The promises of hpcscale/xsite/outer.py, the math of a cross-site (DiLoCo) round:

- the outer step IS torch's SGD(nesterov=True) in fp32, bit for bit, over several rounds, and matches the closed
  form of rounds 1 and 2 (buf = Δ̄ on the first step, not 0·μ + Δ̄);
- η = 1, μ = 0 is federated averaging; the sign of Δ is pinned (sites moved up ⇒ the global weights move up);
- an aggregator rebuilt from its saved state (through a safetensors file) continues bit-identically;
- every encoding keeps its documented error bound (module docstring of outer.py) for random shapes, including
  0-size, 0-dim, one-element, chunk-boundary, constant and huge/tiny/subnormal tensors; fp32 is exact;
- decode, which reads other sites' payloads, refuses malformed ones with BadInput and never raises anything else;
- median and trimmed mean shrug off a poisoned site, and norm_outliers names that site and no other.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hpcscale.errors import BadInput
from hpcscale.xsite.outer import (
    CHUNK,
    DEFAULT_LR,
    DEFAULT_MOMENTUM,
    OuterStep,
    aggregate,
    check_finite,
    decode,
    delta,
    encode,
    encoded_bytes,
    l2_norm,
    norm_outliers,
    reference_rounds,
    shapes_of,
)

FP32_MAX = torch.finfo(torch.float32).max
SLOW = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])


def _theta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(17, 8, generator=g),
        "blocks.0.mlp.bias": torch.randn(8, generator=g),
        "scale": torch.randn((), generator=g),
    }


def _random_like(theta: dict[str, torch.Tensor], seed: int, scale: float = 0.01) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * scale for n, t in theta.items()}


# ---------------------------------------------------------------------------------------------------------------
# Δ and the outer step


def test_delta_is_global_minus_local_in_fp32():
    glob = {"w": torch.tensor([1.0, 2.0, 3.0])}
    local = {"w": torch.tensor([1.5, 2.0, 0.0], dtype=torch.bfloat16)}
    d = delta(glob, local)
    assert d["w"].dtype == torch.float32
    assert torch.equal(d["w"], torch.tensor([-0.5, 0.0, 3.0]))


def test_delta_names_the_first_mismatches():
    glob = {f"layer{i}": torch.zeros(2) for i in range(8)} | {"w": torch.zeros(3)}
    local = {f"layer{i}": torch.zeros(2) for i in range(1, 8)} | {"w": torch.zeros(4), "extra": torch.zeros(1)}
    with pytest.raises(BadInput) as e:
        delta(glob, local)
    text = str(e.value)
    assert "layer0: missing" in text and "extra: unexpected" in text and "w: shape (4,), expected (3,)" in text
    with pytest.raises(BadInput, match="floating-point"):
        delta({"w": torch.zeros(3)}, {"w": torch.zeros(3, dtype=torch.int64)})


def test_outer_step_is_torch_sgd_nesterov_exactly():
    theta0 = _theta()
    lr, mu = DEFAULT_LR, DEFAULT_MOMENTUM
    outer = OuterStep(theta0, lr=lr, momentum=mu)
    # torch's own SGD by hand, on Parameters, as a user would write it
    params = {n: torch.nn.Parameter(t.clone()) for n, t in theta0.items()}
    sgd = torch.optim.SGD(params.values(), lr=lr, momentum=mu, nesterov=True)
    for r in range(6):
        avg = _random_like(theta0, seed=100 + r, scale=0.1 * (r + 1))
        kept = {n: t.clone() for n, t in avg.items()}
        outer.apply(avg)
        for n, p in params.items():
            p.grad = avg[n].clone()
        sgd.step()
        state = outer.state()
        for n, p in params.items():
            assert torch.equal(state.theta[n], p.detach()), (r, n)
            assert torch.equal(state.momentum_buffers[n], sgd.state[p]["momentum_buffer"]), (r, n)
            assert torch.equal(avg[n], kept[n]), "apply wrote into the caller's Δ̄"


def test_outer_step_closed_form_rounds_1_and_2():
    theta0, lr, mu = _theta(1), 0.7, 0.9
    d1, d2 = _random_like(theta0, 7, 0.5), _random_like(theta0, 8, 0.5)
    outer = OuterStep(theta0, lr=lr, momentum=mu)
    outer.apply(d1)
    after1 = outer.state()
    outer.apply(d2)
    after2 = outer.state()
    for n, t in theta0.items():
        # the same fp32 operations torch performs (add with alpha is one fused operation): exact
        buf1 = d1[n].clone()  # round 1: buf = Δ̄ (torch clones the first gradient)
        theta1 = t.add(d1[n].add(buf1, alpha=mu), alpha=-lr)  # θ − η·(Δ̄ + μ·buf)
        buf2 = buf1.mul(mu).add(d2[n])  # round 2: buf = μ·buf + Δ̄
        theta2 = theta1.add(d2[n].add(buf2, alpha=mu), alpha=-lr)
        assert torch.equal(after1.theta[n], theta1) and torch.equal(after1.momentum_buffers[n], buf1)
        assert torch.equal(after2.theta[n], theta2) and torch.equal(after2.momentum_buffers[n], buf2)
        # and the textbook formula in float64
        x, g1, g2 = t.double(), d1[n].double(), d2[n].double()
        x1 = x - lr * (g1 + mu * g1)
        x2 = x1 - lr * (g2 + mu * (mu * g1 + g2))
        torch.testing.assert_close(after2.theta[n].double(), x2, rtol=1e-6, atol=1e-6)


@SLOW
@given(
    weights=st.lists(st.floats(0.5, 1e6), min_size=1, max_size=5),
    seed=st.integers(0, 2**31),
    rounds=st.integers(1, 3),
)
def test_lr_1_momentum_0_is_federated_averaging(weights, seed, rounds):
    theta0 = _theta(seed)
    moves = [_random_like(theta0, seed + 1 + i, scale=1.0) for i in range(len(weights))]
    seen = []

    def site(i):
        def fn(theta):
            local = {n: t + moves[i][n] * (1 + theta[n].abs()) for n, t in theta.items()}
            seen.append((i, local))
            return local

        return fn

    history = reference_rounds(
        theta0, [site(i) for i in range(len(weights))], rounds, lr=1.0, momentum=0.0, weights=weights
    )
    last_round = seen[-len(weights) :]
    total = sum(weights)
    for n in theta0:
        mean = sum(weights[i] * local[n].double() for i, local in last_round) / total
        torch.testing.assert_close(history[-1][n].double(), mean, rtol=1e-6, atol=1e-6)


def test_the_sign_is_pinned():
    theta0 = {"w": torch.tensor([0.0, 1.0, -2.0, 100.0])}

    def up_by_one(theta):
        return {n: t + 1 for n, t in theta.items()}

    assert torch.equal(delta(theta0, up_by_one(theta0))["w"], torch.full((4,), -1.0))
    (fedavg,) = reference_rounds(theta0, [up_by_one, up_by_one, up_by_one], 1, lr=1.0, momentum=0.0)
    assert torch.equal(fedavg["w"], theta0["w"] + 1)  # every site went up by 1: so does θ, exactly
    (diloco,) = reference_rounds(theta0, [up_by_one] * 2, 1)  # defaults: η = 0.7, μ = 0.9
    assert bool((diloco["w"] > theta0["w"]).all())
    torch.testing.assert_close(diloco["w"], theta0["w"] + 0.7 * 1.9)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_restart_continues_bit_identically(tmp_path, k):
    theta0 = _theta(3)
    steps = [_random_like(theta0, 200 + r, 0.2) for r in range(k + 4)]
    never_stopped = OuterStep(theta0)
    for d in steps[:k]:
        never_stopped.apply(d)
    saved = never_stopped.state()
    theta_saved, momentum_saved = saved  # state() unpacks as (theta, momentum)
    assert saved.theta is theta_saved and bool(momentum_saved) == (k > 0)
    # through a file, as an aggregator saves it
    path = tmp_path / "outer.safetensors"
    save_file(
        {f"theta/{n}": t for n, t in saved.theta.items()}
        | {f"momentum/{n}": t for n, t in saved.momentum_buffers.items()},
        str(path),
    )
    loaded = load_file(str(path))
    theta = {n.split("/", 1)[1]: t for n, t in loaded.items() if n.startswith("theta/")}
    momentum = {n.split("/", 1)[1]: t for n, t in loaded.items() if n.startswith("momentum/")}
    restarted = OuterStep.from_state(theta, momentum or None, lr=DEFAULT_LR, momentum=DEFAULT_MOMENTUM)
    for d in steps[k:]:
        never_stopped.apply(d)
        restarted.apply(d)
        a, b = never_stopped.state(), restarted.state()
        for n in theta0:
            assert torch.equal(a.theta[n], b.theta[n]) and torch.equal(a.momentum_buffers[n], b.momentum_buffers[n])


def test_restore_refuses_bad_buffers():
    theta = _theta()
    buffers = _random_like(theta, 5)
    partial = dict(list(buffers.items())[:1])
    with pytest.raises(BadInput, match="missing"):
        OuterStep(theta, momentum_buffers=partial)
    with pytest.raises(BadInput, match="shape"):
        OuterStep(theta, momentum_buffers=buffers | {"scale": torch.zeros(2)})
    with pytest.raises(BadInput, match="non-finite"):
        OuterStep(theta, momentum_buffers=buffers | {"scale": torch.tensor(float("nan"))})
    with pytest.raises(BadInput, match="momentum is 0"):
        OuterStep(theta, momentum=0.0, momentum_buffers=buffers)
    for bad in ({"lr": 0.0}, {"lr": float("nan")}, {"momentum": 1.0}, {"momentum": -0.1}):
        with pytest.raises(BadInput):
            OuterStep(theta, **bad)


def test_apply_refuses_mismatched_or_non_finite_delta():
    outer = OuterStep(_theta())
    good = _random_like(_theta(), 1)
    with pytest.raises(BadInput, match="missing"):
        outer.apply({n: t for n, t in good.items() if n != "scale"})
    with pytest.raises(BadInput, match="non-finite"):
        outer.apply(good | {"scale": torch.tensor(float("inf"))})
    assert not outer.state().momentum_buffers  # refused: nothing moved


# ---------------------------------------------------------------------------------------------------------------
# Encodings and their bounds


def _ulp32(m: torch.Tensor) -> torch.Tensor:
    """fp32's spacing at |m| (float64 in, float64 out); 2^-149 at and below the subnormal range."""
    _, exp = torch.frexp(m.abs())
    return torch.maximum(torch.pow(2.0, (exp - 24).to(torch.float64)), torch.tensor(2.0**-149, dtype=torch.float64))


def _assert_int8_bound(x: torch.Tensor, payload: dict, got: torch.Tensor, name: str = "x") -> None:
    flat, back = x.reshape(-1).double(), got.reshape(-1).double()
    if flat.numel() == 0:
        return
    idx = torch.arange(flat.numel()) // CHUNK
    lo, step = payload[f"{name}/lo"].double()[idx], payload[f"{name}/step"].double()[idx]
    hi = lo + 255 * step
    clipped = torch.minimum(torch.maximum(flat, lo), hi)
    bound = (flat - clipped).abs() + step / 2 + _ulp32(torch.maximum(lo.abs(), hi.abs()))
    err = (flat - back).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"element {worst}: x={flat[worst]} x̂={back[worst]} err={err[worst]} bound={bound[worst]}"
    )


def _assert_bf16_bound(x: torch.Tensor, got: torch.Tensor) -> None:
    flat, back = x.reshape(-1).double(), got.reshape(-1).double()
    normal = flat.abs() >= 2.0**-126
    bound = torch.where(normal, flat.abs() * 2.0**-8, flat.abs())
    assert bool(((flat - back).abs() <= bound).all())


SHAPES = st.one_of(
    st.sampled_from([(), (0,), (1,), (3, 0), (CHUNK,), (CHUNK - 1,), (CHUNK + 1,), (2, CHUNK + 3), (3, 1, 4097)]),
    st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple),
)


@st.composite
def deltas(draw) -> torch.Tensor:
    """A tensor of a random shape filled one of several ways (Gaussian at any scale and offset, constant,
    arbitrary fp32 values, Gaussian with planted outliers)."""
    shape = draw(SHAPES)
    n = math.prod(shape)
    kind = draw(
        st.sampled_from(
            ["gaussian", "constant", "any", "outliers"] if n <= 64 else ["gaussian", "constant", "outliers"]
        )
    )
    finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
    if kind == "constant":
        return torch.full(shape, draw(finite32), dtype=torch.float32)
    if kind == "any":
        return torch.tensor(draw(st.lists(finite32, min_size=n, max_size=n)), dtype=torch.float32).reshape(shape)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = 10.0 ** draw(st.integers(-45, 37))
    offset = draw(st.sampled_from([0.0, 1.0, -3.0, 1e3])) * scale
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale + offset).clamp(-FP32_MAX, FP32_MAX)
    if kind == "outliers" and n:
        where = torch.randint(0, n, (max(1, n // 1000),), generator=g)
        x[where] = x[where] * 1e4 + scale * 1e6
    return x.clamp(-FP32_MAX, FP32_MAX).to(torch.float32).reshape(shape)


@SLOW
@given(x=deltas())
def test_round_trips_keep_their_bounds(x):
    shapes = {"x": tuple(x.shape)}
    fp32 = decode(encode({"x": x}, "fp32"), "fp32", shapes)["x"]
    assert fp32.dtype == torch.float32 and torch.equal(fp32, x)

    payload = encode({"x": x}, "int8")
    assert sum(t.numel() * t.element_size() for t in payload.values()) == encoded_bytes(shapes, "int8")
    got = decode(payload, "int8", shapes)["x"]
    assert got.shape == x.shape and got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    _assert_int8_bound(x, payload, got)
    if x.numel() and bool((x == x.reshape(-1)[0]).all()):
        assert torch.equal(got, x)  # a constant tensor decodes exactly

    if not bool(torch.isfinite(x.to(torch.bfloat16)).all()):
        with pytest.raises(BadInput, match="bf16"):
            encode({"x": x}, "bf16")
        return
    payload = encode({"x": x}, "bf16")
    assert payload["x"].dtype == torch.bfloat16
    got = decode(payload, "bf16", shapes)["x"]
    assert got.shape == x.shape and got.dtype == torch.float32
    _assert_bf16_bound(x, got)


def test_int8_range_is_six_sigma_and_clips_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(CHUNK, generator=g)
    x[17] = 1000.0  # far beyond 6σ: clipped
    payload = encode({"x": x}, "int8")
    got = decode(payload, "int8", {"x": (CHUNK,)})["x"]
    lo, step = float(payload["x/lo"][0]), float(payload["x/step"][0])
    mean, sigma = x.double().mean(), x.double().std(correction=0)
    # [m − 6σ, m + 6σ] narrowed to the chunk's [min, max]: here the bottom is the minimum, the top m + 6σ
    assert lo == float(x.min()) and float(mean - 6 * sigma) < lo
    hi = float(mean + 6 * sigma)
    assert hi < 1000.0
    assert step == pytest.approx((hi - lo) / 255, rel=1e-6)
    assert float(got[17]) == pytest.approx(lo + 255 * step, rel=1e-6)  # the top of the range
    inside = torch.ones(CHUNK, dtype=torch.bool)
    inside[17] = False
    assert float((got - x)[inside].abs().max()) <= step / 2 + 1e-6
    _assert_int8_bound(x, payload, got)


def test_edge_tensors_round_trip():
    tensors = {
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(-2.5),
        "one": torch.tensor([1e-40]),
        "huge": torch.tensor([FP32_MAX, -FP32_MAX] * 3000),
        "tiny": torch.tensor([2.0**-149, -(2.0**-149), 0.0] * 2000),
    }
    shapes = shapes_of(tensors)
    for encoding in ("fp32", "int8"):
        payload = encode(tensors, encoding)
        assert sum(t.numel() * t.element_size() for t in payload.values()) == encoded_bytes(shapes, encoding)
        got = decode(payload, encoding, shapes)
        for n, t in tensors.items():
            assert got[n].shape == t.shape and bool(torch.isfinite(got[n]).all())
            if encoding == "int8":
                _assert_int8_bound(t, payload, got[n], n)
    assert torch.equal(decode(encode(tensors, "int8"), "int8", shapes)["scalar"], tensors["scalar"])
    assert encoded_bytes({"x": (CHUNK + 1,)}, "int8") == CHUNK + 1 + 2 * 4 * 2
    assert encoded_bytes({"x": (10,)}, "bf16") == 20 and encoded_bytes({"x": (0,)}, "fp32") == 0


def test_encode_refuses_what_it_cannot_send():
    with pytest.raises(BadInput, match="non-finite"):
        encode({"x": torch.tensor([1.0, float("nan")])}, "int8")
    with pytest.raises(BadInput, match="bf16"):
        encode({"x": torch.tensor([FP32_MAX])}, "bf16")
    with pytest.raises(BadInput, match="unknown encoding"):
        encode({"x": torch.zeros(1)}, "fp8")


# ---------------------------------------------------------------------------------------------------------------
# decode on untrusted payloads


def _good(encoding: str) -> tuple[dict, dict]:
    tensors = {"a": torch.randn(5000), "b.w": torch.randn(3, 4)}
    return encode(tensors, encoding), shapes_of(tensors)


def _nan_at(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.reshape(-1)[0] = value
    return t


MALFORMED = {
    "missing name": ("int8", lambda p: {k: v for k, v in p.items() if k != "a/lo"}, "a/lo: missing"),
    "extra name": ("fp32", lambda p: p | {"c": torch.zeros(1)}, "c: unexpected"),
    "wrong dtype": ("int8", lambda p: p | {"a/q": p["a/q"].to(torch.int8)}, "dtype"),
    "wrong dtype fp32": ("fp32", lambda p: p | {"a": p["a"].double()}, "dtype"),
    "bf16 sent as fp32": ("bf16", lambda p: p | {"a": p["a"].float()}, "dtype"),
    "wrong length q": ("int8", lambda p: p | {"a/q": p["a/q"][:-1]}, "shape"),
    "wrong length lo": ("int8", lambda p: p | {"a/lo": torch.zeros(7)}, "shape"),
    "wrong shape": ("bf16", lambda p: p | {"b.w": p["b.w"].reshape(4, 3)}, "shape"),
    "NaN scale": ("int8", lambda p: p | {"a/step": _nan_at(p["a/step"], float("nan"))}, "non-finite"),
    "inf lo": ("int8", lambda p: p | {"a/lo": _nan_at(p["a/lo"], float("inf"))}, "non-finite"),
    "negative step": ("int8", lambda p: p | {"a/step": -p["a/step"]}, "negative"),
    "range past fp32": ("int8", lambda p: p | {"a/step": p["a/step"] * 0 + 1e37}, "beyond fp32"),
    "NaN value": ("fp32", lambda p: p | {"a": _nan_at(p["a"], float("nan"))}, "non-finite"),
    "not a tensor": ("fp32", lambda p: p | {"a": [1.0] * 5000}, "expected a tensor"),
    "key not a string": ("fp32", lambda p: p | {3: torch.zeros(1)}, "strings"),
    "not a mapping": ("fp32", lambda p: list(p.values()), "mapping"),
    "sparse tensor": ("fp32", lambda p: p | {"a": p["a"].to_sparse()}, "dense CPU"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_decode_refuses_malformed_payloads(case):
    encoding, mutate, reason = MALFORMED[case]
    payload, shapes = _good(encoding)
    with pytest.raises(BadInput, match=reason):
        decode(mutate(payload), encoding, shapes)


VALUES = st.sampled_from([0.0, 1.0, -1.0, 1e38, -1e38, 3.4e38, float("nan"), float("inf"), -float("inf"), 1e-45])
DTYPES = st.sampled_from(
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int64, torch.bool]
)


@st.composite
def tensors(draw):
    dtype = draw(DTYPES)
    shape = draw(st.lists(st.integers(0, 6), max_size=2).map(tuple))
    values = torch.tensor(
        draw(st.lists(VALUES, min_size=math.prod(shape), max_size=math.prod(shape))), dtype=torch.float64
    )
    if dtype.is_floating_point:
        return values.to(dtype).reshape(shape)
    return values.nan_to_num(0.0, 0.0, 0.0).clamp(-100, 100).to(dtype).reshape(shape)


@st.composite
def payloads(draw):
    """Mostly a valid payload with a few mutations; sometimes a dict made up from nothing."""
    encoding = draw(st.sampled_from(["fp32", "bf16", "int8"]))
    shapes = {"a": draw(st.sampled_from([(0,), (1,), (5,), (2, 3), (CHUNK + 2,)])), "b": (2,)}
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    payload = encode({n: torch.randn(s, generator=g) for n, s in shapes.items()}, encoding)
    if draw(st.booleans()) and draw(st.booleans()):
        keys = st.sampled_from([*payload, "a", "a/q", "a/lo", "a/step", "b/q", "c", ""])
        return encoding, shapes, draw(st.dictionaries(keys, tensors(), max_size=8))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*payload, "zzz"]))
        op = draw(st.sampled_from(["drop", "replace", "retype", "truncate", "poison", "scale", "nontensor"]))
        t = payload.get(key)
        t = t if isinstance(t, torch.Tensor) else torch.zeros(1)
        if op == "drop":
            payload.pop(key, None)
        elif op == "replace":
            payload[key] = draw(tensors())
        elif op == "retype":
            payload[key] = t.to(draw(DTYPES))
        elif op == "truncate":
            payload[key] = t.reshape(-1)[: draw(st.integers(0, max(0, t.numel() - 1)))]
        elif op == "poison" and t.numel():
            payload[key] = _nan_at(t, draw(VALUES)) if t.is_floating_point() else t
        elif op == "scale":
            payload[key] = t * draw(VALUES) if t.is_floating_point() else t
        elif op == "nontensor":
            payload[key] = draw(st.sampled_from([None, 1.0, "x", [1, 2]]))
    return encoding, shapes, payload


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(case=payloads())
def test_decode_returns_finite_tensors_or_raises_bad_input(case):
    encoding, shapes, payload = case
    try:
        got = decode(payload, encoding, shapes)
    except BadInput:
        return
    assert set(got) == set(shapes)
    for name, shape in shapes.items():
        assert tuple(got[name].shape) == shape and got[name].dtype == torch.float32
        assert bool(torch.isfinite(got[name]).all())


# ---------------------------------------------------------------------------------------------------------------
# Checks and aggregation


def test_check_finite_names_the_tensor_and_index():
    assert check_finite({"a": torch.zeros(3), "n": torch.arange(3)}) is None
    reason = check_finite({"a": torch.zeros(3), "b": torch.tensor([0.0, float("inf"), float("nan")])})
    assert reason is not None and reason.startswith("b: 2 non-finite values, the first at flat index 1: inf")
    reason = check_finite({"x": torch.tensor([float("nan")]), "y": torch.tensor([float("nan")])})
    assert reason is not None and "x:" in reason and "1 more tensors" in reason


def _poisoned_round():
    honest = [_random_like(_theta(), seed, 0.01) for seed in (1, 2, 3)]
    poisoned = {n: torch.full_like(t, 1e6) for n, t in honest[0].items()}
    return honest, poisoned


@pytest.mark.parametrize(("rule", "trim"), [("median", 0.2), ("trimmed_mean", 0.25)])
def test_robust_rules_reject_a_poisoned_site(rule, trim):
    honest, poisoned = _poisoned_round()
    contributions = [(1.0, d) for d in honest] + [(1e9, poisoned)]  # the liar also claims a huge token count
    robust = aggregate(contributions, rule=rule, trim=trim)
    mean = aggregate(contributions)
    for n in honest[0]:
        stacked = torch.stack([d[n] for d in honest])
        assert bool((robust[n] >= stacked.min(0).values).all() and (robust[n] <= stacked.max(0).values).all())
        assert float(mean[n].abs().min()) > 1e5  # the plain mean is captured
    norms = {f"site{i}": l2_norm(d) for i, d in enumerate(honest)} | {"liar": l2_norm(poisoned)}
    assert set(norm_outliers(norms)) == {"liar"}


def test_aggregation_rules_on_known_values():
    def c(*values, w=1.0):
        return (w, {"x": torch.tensor(values)})

    assert torch.equal(aggregate([c(1.0), c(2.0, w=3.0)])["x"], torch.tensor([1.75]))
    assert torch.equal(aggregate([c(1.0), c(2.0), c(10.0), c(4.0)], rule="median")["x"], torch.tensor([3.0]))
    assert torch.equal(aggregate([c(1.0), c(2.0), c(10.0)], rule="median")["x"], torch.tensor([2.0]))
    # k = floor(trim·n): 0.2 of 4 sites trims nothing, 0.25 trims one from each end
    four = [c(1.0), c(2.0), c(10.0), c(4.0)]
    assert torch.equal(aggregate(four, rule="trimmed_mean", trim=0.2)["x"], torch.tensor([4.25]))
    assert torch.equal(aggregate(four, rule="trimmed_mean", trim=0.25)["x"], torch.tensor([3.0]))
    for bad in ([], [c(1.0, w=0.0)], [c(1.0, w=float("nan"))], [c(1.0), (1.0, {"y": torch.zeros(1)})]):
        with pytest.raises(BadInput):
            aggregate(bad)
    with pytest.raises(BadInput, match="unknown rule"):
        aggregate([c(1.0)], rule="krum")
    with pytest.raises(BadInput, match="trim"):
        aggregate([c(1.0)], rule="trimmed_mean", trim=0.5)


def test_norm_outliers_rule():
    assert set(norm_outliers({"a": 1.0, "b": 1.2, "c": 0.9, "d": 50.0})) == {"d"}
    # two liars among five are both flagged; small norms never are
    flagged = norm_outliers({"a": 1.0, "b": 1.1, "c": 0.001, "x": 500.0, "y": 800.0})
    assert set(flagged) == {"x", "y"}
    # two sites: only an absurd ratio (> factor²), and only the larger
    assert norm_outliers({"a": 1.0, "b": 50.0}) == {}
    assert set(norm_outliers({"a": 1.0, "b": 101.0})) == {"b"}
    assert norm_outliers({"a": 0.0, "b": 1e9}) == {}
    assert norm_outliers({"a": 1e9}) == {}
    # invalid norms, whatever the count
    assert set(norm_outliers({"a": float("nan"), "b": -1.0, "c": 1.0})) == {"a", "b"}
    assert "median of the other sites" in norm_outliers({"a": 1.0, "b": 1.0, "c": 11.0})["c"]
    assert norm_outliers({"a": 1.0, "b": 1.0, "c": 9.0}) == {}


def test_reference_rounds_with_int8_track_fp32():
    theta0 = _theta(9)
    fns = [lambda th, i=i: {n: t - 0.05 * (t - i) for n, t in th.items()} for i in range(3)]
    exact = reference_rounds(theta0, fns, 3, weights=[1.0, 2.0, 3.0])
    int8 = reference_rounds(theta0, fns, 3, weights=[1.0, 2.0, 3.0], encoding="int8")
    bf16 = reference_rounds(theta0, fns, 3, weights=[1.0, 2.0, 3.0], encoding="bf16")
    for n in theta0:
        torch.testing.assert_close(int8[-1][n], exact[-1][n], rtol=0, atol=5e-3)
        torch.testing.assert_close(bf16[-1][n], exact[-1][n], rtol=0, atol=5e-3)
        assert not torch.equal(exact[-1][n], theta0[n])


def test_the_experiment_counts_bytes_from_the_shared_start(tmp_path):
    """scripts/experiments/diloco_vs_ddp.py --shared-start W, in small: every run shares the synchronous run's
    first W steps, and only what each sends after W counts (the synchronous run: one fp32 gradient per step;
    DiLoCo: one contribution per round of H)."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "experiments" / "diloco_vs_ddp.py"), "--steps", "20", "--seeds", "1",
         "--eval-every", "10", "--shared-start", "10", "--outer", "5:0.7:0.7", "--encodings", "fp32",
         "--compression", "none", "--jobs", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "diloco_vs_ddp.json").read_text())
    ddp, diloco = doc["runs"]
    params = ddp["params"]
    assert ddp["bytes_sent_per_site"] == 10 * 4 * params  # steps 10..19, not the shared 0..9
    rounds = 2  # boundaries at steps 15 and 20
    # one uncompressed fp32 payload per round: 4 bytes per parameter plus the safetensors header
    assert rounds * 4 * params < diloco["bytes_sent_per_site"] < rounds * (4 * params + 65536)
    first = ddp["curve"][0]
    # the shared start: the same training, up to float summation order (two half-batch means vs one mean)
    shared = diloco["curve"][0]
    assert first["step"] == shared["step"] == 10 and first["bytes"] == shared["bytes"] == 0
    assert shared["val_loss"] == pytest.approx(first["val_loss"], rel=1e-6)
    assert (tmp_path / "loss_vs_tokens.png").stat().st_size > 0 and (tmp_path / "loss_vs_bytes.png").exists()

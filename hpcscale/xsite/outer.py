"""The math of a cross-site (DiLoCo) round: the contribution Δ, its wire encodings, the checks made on it, the
aggregation rules and the outer optimizer. A pure library: no files, no network, no Slurm.

The round (docs/cross-site.md, "The algorithm"; Douillard et al., "DiLoCo", arXiv:2311.08105):
1. every site starts from the published global θ(r−1) and takes H inner steps, reaching θ_i;
2. it contributes Δ_i = θ(r−1) − θ_i (`delta`). THE SIGN: Δ points the way a gradient points, against the
   direction the site moved, so the outer optimizer *descends* along it. A site whose weights went up by +1
   contributes −1 and the global weights go up (torchft once had this sign backwards; the tests pin it);
3. the aggregator averages Δ̄ = Σ w_i Δ_i / Σ w_i (`aggregate`; w_i = tokens seen, or equal), or takes the
   coordinate-wise median or trimmed mean when sites may be faulty;
4. it applies `torch.optim.SGD(lr=η, momentum=μ, nesterov=True)` to θ in fp32 with Δ̄ as the gradient
   (`OuterStep`; defaults η = 0.7, μ = 0.9 as in DiLoCo). torch's arithmetic, exactly:
       round 1:  buf = Δ̄                       (torch clones the first gradient: no 0·μ + Δ̄)
       round r:  buf = μ·buf + Δ̄
       update  = Δ̄ + μ·buf;   θ ← θ − η·update
   With η = 1, μ = 0 this is federated averaging: θ(r) = Σ w_i θ_i / Σ w_i. torch refuses nesterov=True with
   μ = 0, and for μ = 0 Nesterov and plain SGD are the same update, so μ = 0 runs plain SGD.
   Restart: θ and the momentum buffers are the whole state (`OuterStep.state`); `OuterStep.from_state` puts
   the saved buffer back as torch's own `momentum_buffer`, so a restarted aggregator continues bit-identically
   to one that never stopped. No buffers (none saved yet) is torch's fresh start: the next Δ̄ becomes the buffer.
   The optimizer runs torch's single-tensor SGD (foreach=False) so the bits do not depend on the device.

Encodings of Δ for the wire (`encode` → a flat dict of tensors ready for a safetensors file; `decode` → fp32).
x is an element of Δ (fp32), x̂ what `decode` gives back:
- "fp32": `name` → the tensor itself. Exact: x̂ = x.
- "bf16": `name` → Δ rounded to bfloat16 (round to nearest even). For |x| ≥ 2^-126 (fp32's normal range)
  |x − x̂| ≤ 2^-8·|x|; for smaller (subnormal) x, |x − x̂| ≤ |x| (x̂ is the nearest bf16 value, or 0 where
  the CPU's conversion instruction flushes subnormals to zero). A Δ with an element that rounds past bf16's
  largest value (|x| ≥ (2 − 2^-8)·2^127 ≈ 3.396e38) is refused by `encode` rather than sent as inf.
- "int8": uniform 8-bit binning per chunk (Streaming DiLoCo, arXiv:2501.18512; INTELLECT-1, arXiv:2412.01152).
  The tensor is flattened and cut into chunks of CHUNK = 4096 elements (the last may be shorter). For each
  chunk, with mean m and population standard deviation s, the range is [lo, hi] = [m − 6s, m + 6s] narrowed to
  the chunk's [min, max] (levels outside the data are wasted, and the narrowing keeps lo and hi finite in
  fp32); step = (hi − lo)/255 and each element is sent as q = round((clip(x) − lo)/step) ∈ [0, 255] (uint8),
  decoded as x̂ = lo + q·step. `name/q` (uint8, numel elements, flattened), `name/lo` and `name/step` (fp32,
  one per chunk) are stored; the range is the stored one, hi = lo + 255·step. The bound, for every element:
      |x − x̂| ≤ |x − clip(x, lo, hi)| + step/2 + ulp32(max(|lo|, |hi|))
  where the first term is 0 for x inside the range (6σ clips almost nothing: only a chunk with extreme outliers
  loses them) and the last term is fp32's spacing at the range's magnitude: the rounding of x̂ to fp32.
  A constant chunk (s = 0) has step = 0 and decodes exactly. A zero-size tensor has no chunks and decodes to
  an empty tensor; a one-element tensor is a constant chunk.
`decode` runs on what other sites sent: it refuses, with a reason (BadInput), a payload whose names differ from
the expected ones, a tensor of the wrong dtype, shape or length, a tensor not on the CPU, non-finite values,
and int8 scales that are non-finite, negative or reach past fp32's range. What it accepts decodes to finite
fp32 tensors of the expected shapes. `encoded_bytes` counts the tensor bytes (not the safetensors header).

Checks on contributions (`check_finite`, `norm_outliers`) and the aggregation rules (`aggregate`) are
documented where they are defined. `reference_rounds` runs whole rounds in one process, for tests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from hpcscale.errors import BadInput

DEFAULT_LR = 0.7  # η, DiLoCo's outer learning rate
DEFAULT_MOMENTUM = 0.9  # μ, DiLoCo's outer Nesterov momentum
DEFAULT_OUTLIER_FACTOR = 10.0  # norm_outliers: how far above the other sites' median norm is suspicious

ENCODINGS = ("fp32", "bf16", "int8")
CHUNK = 4096  # int8: elements per (lo, step) pair
INT8_LEVELS = 256
INT8_SIGMAS = 6.0  # int8: the range is the chunk mean ± this many standard deviations
_BLOCK = 256 * CHUNK  # int8 works through a tensor this many elements at a time (float64 temporaries)
_FP32_MAX = torch.finfo(torch.float32).max

AGGREGATION_RULES = ("auto", "mean", "median", "trimmed_mean")
DEFAULT_MAX_DELTA_RATIO = 100.0  # screen: ‖Δ‖ above this × max(‖θ(base)‖, 1) is no site's honest work
DEFAULT_MAX_WEIGHT_RATIO = 2.0  # capped_weights: a site's weight at most this × the median of the others'
HISTORY_ROUNDS = 5  # screen: the recent rounds whose accepted norms bound a new contribution's
MAX_PUBLISHED_ABS = 1e9  # check_outer_result: no element of θ or the momentum a round publishes is larger
_LISTED = 5  # mismatches named in an error message; the rest are counted


# ---------------------------------------------------------------------------------------------------------------
# Δ and shapes


def shapes_of(tensors: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    """name -> shape, the form `decode` and `encoded_bytes` take."""
    return {name: tuple(t.shape) for name, t in tensors.items()}


def _mismatches(expected: Mapping[str, tuple], got: Mapping[str, tuple]) -> list[str]:
    problems = [f"{n}: missing" for n in sorted(expected.keys() - got.keys())]
    problems += [f"{n}: unexpected" for n in sorted(got.keys() - expected.keys())]
    for n in sorted(expected.keys() & got.keys()):
        if tuple(got[n]) != tuple(expected[n]):
            problems.append(f"{n}: shape {tuple(got[n])}, expected {tuple(expected[n])}")
    return problems


def _listing(problems: list[str]) -> str:
    more = f" and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
    return "; ".join(problems[:_LISTED]) + more


def _require_same_shapes(expected: Mapping[str, Tensor], got: Mapping[str, Tensor], what: str) -> None:
    for name, t in got.items():
        if not isinstance(t, Tensor) or not (t.is_floating_point()):
            kind = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise BadInput(f"{what}: {name}: expected a floating-point tensor, got {kind}")
    problems = _mismatches(shapes_of(expected), shapes_of(got))
    if problems:
        raise BadInput(f"{what}: names or shapes differ ({len(problems)}): {_listing(problems)}")


def delta(global_theta: Mapping[str, Tensor], local_theta: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Δ = global − local in fp32, per name (on global's device). Names and shapes must match exactly."""
    _require_same_shapes(global_theta, global_theta, "delta: global θ")
    _require_same_shapes(global_theta, local_theta, "delta: local θ against global θ")
    out = {}
    for name, g in global_theta.items():
        g32 = g.detach().to(torch.float32)
        out[name] = g32 - local_theta[name].detach().to(device=g.device, dtype=torch.float32)
    return out


def l2_norm(tensors: Mapping[str, Tensor]) -> float:
    """‖Δ‖₂ over every element of every tensor (the input of `screen`): each tensor's norm in fp32, squared and
    summed in float64. A tensor whose squares overflow fp32 is measured in float64 instead, so a finite input
    always has its true norm; no fp64 copy of a tensor is made otherwise (one pass over the bytes)."""
    total = 0.0
    for t in tensors.values():
        t = t.detach()
        n = float(torch.linalg.vector_norm(t if t.dtype in (torch.float32, torch.float64) else t.float()))
        if math.isinf(n) and _all_finite(t):
            n = float(torch.linalg.vector_norm(t.to(torch.float64)))
        total += n * n
    return math.sqrt(total)


# ---------------------------------------------------------------------------------------------------------------
# Encodings


def _payload_spec(shapes: Mapping[str, tuple], encoding: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """payload key -> (dtype, shape) that `encode` writes for these shapes: the one owner of the wire layout."""
    if encoding not in ENCODINGS:
        raise BadInput(f"unknown encoding '{encoding}' (one of {', '.join(ENCODINGS)})")
    spec = {}
    for name, shape in shapes.items():
        if not isinstance(name, str) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadInput(f"expected shapes: {name!r}: {shape!r} is not a name and a shape")
        shape = tuple(shape)
        if encoding == "fp32":
            spec[name] = (torch.float32, shape)
        elif encoding == "bf16":
            spec[name] = (torch.bfloat16, shape)
        else:
            numel = math.prod(shape)
            chunks = -(-numel // CHUNK)
            spec[f"{name}/q"] = (torch.uint8, (numel,))
            spec[f"{name}/lo"] = (torch.float32, (chunks,))
            spec[f"{name}/step"] = (torch.float32, (chunks,))
    return spec


def encoded_bytes(shapes: Mapping[str, tuple], encoding: str) -> int:
    """Bytes of tensor data `encode` produces for these shapes (the safetensors header comes on top)."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in _payload_spec(shapes, encoding).values())


def contribution_bound(shapes: Mapping[str, tuple]) -> int:
    """The largest payload file a contribution to a model of these shapes can need, compressed or not: its
    tensors in the widest encoding and the largest safetensors header a reader takes. The aggregator reads
    contributions within it, so a site cannot make it read or inflate more than the model's size."""
    from hpcscale.xsite.roundfile import MAX_PAYLOAD_HEADER_BYTES

    return 8 + MAX_PAYLOAD_HEADER_BYTES + max(encoded_bytes(shapes, e) for e in ENCODINGS)


def encode(delta: Mapping[str, Tensor], encoding: str) -> dict[str, Tensor]:
    """Δ (any floating dtype, taken as fp32) → the flat dict of contiguous CPU tensors that goes on the wire.
    Refuses a non-finite Δ, and for bf16 one whose elements round past bf16's range."""
    _payload_spec(shapes_of(delta), encoding)  # the encoding's name and the shapes
    reason = check_finite(delta)
    if reason:
        raise BadInput(f"encode: {reason}")
    out: dict[str, Tensor] = {}
    for name, t in delta.items():
        x = t.detach().to(device="cpu", dtype=torch.float32)
        if encoding == "fp32":
            out[name] = x.contiguous()
        elif encoding == "bf16":
            b = x.to(torch.bfloat16).contiguous()
            if not _all_finite(b):
                raise BadInput(f"encode: {name}: elements beyond bf16's range (|x| ≥ 3.396e38); send fp32")
            out[name] = b
        else:
            out[f"{name}/q"], out[f"{name}/lo"], out[f"{name}/step"] = _int8_encode(x.reshape(-1))
    return out


def _chunk_index(n: int) -> Tensor:
    return torch.arange(n) // CHUNK


def _int8_encode(flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """flat (n,) fp32 → q (n,) uint8, lo and step (ceil(n/CHUNK),) fp32."""
    n = flat.numel()
    q = torch.empty(n, dtype=torch.uint8)
    lo = torch.empty(-(-n // CHUNK), dtype=torch.float32)
    step = torch.empty_like(lo)
    for start in range(0, n, _BLOCK):
        v = flat[start : start + _BLOCK].to(torch.float64)  # (m,), m ≤ _BLOCK; chunk-aligned
        first = start // CHUNK
        q_b, lo_b, step_b = _int8_block(v)
        q[start : start + v.numel()] = q_b
        lo[first : first + lo_b.numel()] = lo_b
        step[first : first + step_b.numel()] = step_b
    return q, lo, step


def _int8_block(v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    idx = _chunk_index(v.numel())  # (m,) chunk of each element
    chunks = int(idx[-1]) + 1
    count = torch.bincount(idx, minlength=chunks).to(torch.float64)
    mean = torch.zeros(chunks, dtype=torch.float64).index_add_(0, idx, v) / count
    var = torch.zeros(chunks, dtype=torch.float64).index_add_(0, idx, (v - mean[idx]) ** 2) / count
    sigma = var.sqrt()
    vmin = torch.full((chunks,), math.inf, dtype=torch.float64).scatter_reduce_(0, idx, v, "amin")
    vmax = torch.full((chunks,), -math.inf, dtype=torch.float64).scatter_reduce_(0, idx, v, "amax")
    lo64 = torch.clamp(mean - INT8_SIGMAS * sigma, vmin, vmax)
    hi64 = torch.maximum(torch.minimum(mean + INT8_SIGMAS * sigma, vmax), lo64)
    lo = lo64.to(torch.float32)  # within [vmin, vmax]: fp32 values, so rounding stays finite
    step = ((hi64 - lo64) / (INT8_LEVELS - 1)).to(torch.float32)
    # step rounded up may put lo + 255·step past fp32's largest value; a few ulps down keep it in range
    for _ in range(4):
        over = lo.to(torch.float64) + (INT8_LEVELS - 1) * step.to(torch.float64) > _FP32_MAX
        if not bool(over.any()):
            break
        step = torch.where(over, torch.nextafter(step, torch.zeros_like(step)), step)
    lo_d, step_d = lo.to(torch.float64)[idx], step.to(torch.float64)[idx]
    clipped = torch.minimum(torch.maximum(v, lo_d), lo_d + (INT8_LEVELS - 1) * step_d)
    t = torch.where(step_d > 0, (clipped - lo_d) / torch.where(step_d > 0, step_d, 1.0), 0.0)
    q = t.round().clamp_(0, INT8_LEVELS - 1).to(torch.uint8)
    return q, lo, step


def _int8_decode(q: Tensor, lo: Tensor, step: Tensor) -> Tensor:
    n = q.numel()
    out = torch.empty(n, dtype=torch.float32)
    lo64, step64 = lo.to(torch.float64), step.to(torch.float64)
    for start in range(0, n, _BLOCK):
        idx = _chunk_index(min(_BLOCK, n - start)) + start // CHUNK
        qb = q[start : start + idx.numel()].to(torch.float64)
        out[start : start + idx.numel()] = (lo64[idx] + qb * step64[idx]).to(torch.float32)
    return out


def decode(payload: Mapping[str, Tensor], encoding: str, shapes: Mapping[str, tuple]) -> dict[str, Tensor]:
    """A payload from the wire → Δ in fp32 with exactly `shapes`, or BadInput naming what is wrong with it."""
    spec = _payload_spec(shapes, encoding)
    if not isinstance(payload, Mapping):
        raise BadInput(f"payload: expected a mapping of names to tensors, got {type(payload).__name__}")
    bad_keys = [k for k in payload if not isinstance(k, str)]
    if bad_keys:
        raise BadInput(f"payload: names must be strings, got {bad_keys[0]!r}")
    problems = [f"{k}: missing" for k in sorted(spec.keys() - payload.keys())]
    problems += [f"{k}: unexpected" for k in sorted(payload.keys() - spec.keys())]
    if problems:
        raise BadInput(f"payload ({encoding}): names differ ({len(problems)}): {_listing(problems)}")
    for key, (dtype, shape) in spec.items():
        t = payload[key]
        if not isinstance(t, Tensor):
            raise BadInput(f"payload: {key}: expected a tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.device.type != "cpu":
            raise BadInput(f"payload: {key}: expected a dense CPU tensor, got {t.layout} on {t.device}")
        if t.dtype != dtype:
            raise BadInput(f"payload: {key}: dtype {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise BadInput(f"payload: {key}: shape {tuple(t.shape)}, expected {shape}")
        if not _all_finite(t):
            raise BadInput(f"payload: {key}: non-finite values")
    out = {}
    for name, shape in shapes.items():
        shape = tuple(shape)
        if encoding != "int8":
            out[name] = payload[name].detach().to(torch.float32, copy=True)
            continue
        lo, step = payload[f"{name}/lo"].detach(), payload[f"{name}/step"].detach()
        if bool((step < 0).any()):
            raise BadInput(f"payload: {name}/step: negative steps")
        if bool((lo.to(torch.float64) + (INT8_LEVELS - 1) * step.to(torch.float64)).abs().gt(_FP32_MAX).any()):
            raise BadInput(f"payload: {name}: lo + 255·step is beyond fp32's range")
        out[name] = _int8_decode(payload[f"{name}/q"].detach(), lo, step).reshape(shape)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Checks on contributions


def _extremes(t: Tensor) -> tuple[float, float] | None:
    """(min, max) of a real floating-point tensor in one pass (NaN anywhere makes both NaN); None when empty.
    torch.aminmax reads the bytes once and allocates nothing: 7x faster here than isfinite(t).all(), which
    writes a bool tensor the size of t and reads it again."""
    if not t.numel():
        return None
    lo, hi = torch.aminmax(t)
    both = torch.stack((lo, hi)).to(torch.float64).tolist()  # one device sync for the two
    return both[0], both[1]


def _all_finite(t: Tensor) -> bool:
    if t.is_complex():
        return bool(torch.isfinite(t).all())
    if not t.is_floating_point():
        return True
    ends = _extremes(t)
    return ends is None or (math.isfinite(ends[0]) and math.isfinite(ends[1]))


def check_finite(tensors: Mapping[str, Tensor]) -> str | None:
    """None when every element is finite; otherwise a reason naming the first tensor (by name) with NaN or inf,
    how many elements of it are, the first one's flat index and value, and how many tensors are affected."""
    bad = []
    for name in sorted(tensors):
        t = tensors[name].detach()
        if not _all_finite(t):
            bad.append((name, t.reshape(-1), (~torch.isfinite(t)).reshape(-1)))
    if not bad:
        return None
    name, flat, mask = bad[0]
    first = int(mask.nonzero()[0, 0])
    others = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    return f"{name}: {int(mask.sum())} non-finite values, the first at flat index {first}: {float(flat[first])}{others}"


def norm_outliers(norms: Mapping[str, float], factor: float = DEFAULT_OUTLIER_FACTOR) -> dict[str, str]:
    """site -> reason, for the sites whose ‖Δ‖ looks poisoned or broken. The rule, meant to be robust to the
    very sites it looks for:
    - a norm that is not a finite number ≥ 0 is always flagged;
    - with 3 or more sites (counting only those with valid norms), a site is flagged when its norm exceeds
      `factor` × the median of the OTHER sites' norms: leaving the site out keeps it from raising its own bar,
      and the median keeps a minority of poisoned sites from raising one another's (2 large sites among 4
      are both flagged). Sites that moved less (fewer tokens, a stall) are never flagged: Δ's scale grows with
      the steps taken, and a small Δ harms no average much. A median of 0 (the others did not move) flags
      every site that did move;
    - with 2 sites neither can outvote the other: only an absurd ratio is flagged, the larger norm when it
      exceeds `factor`² × the smaller and the smaller is not 0;
    - 1 site: nothing (beyond invalid norms).
    """
    if not (math.isfinite(factor) and factor >= 1):
        raise BadInput(f"norm_outliers: factor must be a finite number ≥ 1, got {factor}")
    flagged = {}
    valid = {}
    for site, value in norms.items():
        value = float(value)
        if math.isfinite(value) and value >= 0:
            valid[site] = value
        else:
            flagged[site] = f"‖Δ‖ = {value} is not a finite non-negative number"
    if len(valid) >= 3:
        for site, value in valid.items():
            median = statistics.median(v for s, v in valid.items() if s != site)
            if value > factor * median:
                flagged[site] = f"‖Δ‖ = {value:.6g} > {factor:g} × {median:.6g}, the median of the other sites"
    elif len(valid) == 2:
        (small_site, small), (large_site, large) = sorted(valid.items(), key=lambda item: item[1])
        if small > 0 and large > factor**2 * small:
            flagged[large_site] = f"‖Δ‖ = {large:.6g} > {factor**2:g} × {small:.6g}, the other site's ({small_site})"
    return flagged


class Screen(NamedTuple):
    """What `screen` decided: contributions refused or held out of this round (site -> reason), and those scaled
    down to their bound (site -> (factor ≤ 1, reason))."""

    rejected: dict[str, str]
    clipped: dict[str, tuple[float, str]]


class _Scale(NamedTuple):
    value: float  # a site's usual ‖Δ‖
    how: str  # where it comes from, for a reason


def _recent(values: Sequence[float]) -> list[float]:
    """The norms of a history that can make a scale: finite numbers > 0 (a stored norm is read from a file)."""
    out = []
    for v in values:
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 0 < v <= _FP32_MAX:
            out.append(float(v))
    return out


def _scales(norms: Mapping[str, float], history: Mapping[str, Sequence[float]]) -> dict[str, _Scale]:
    """site -> its scale: the median of its norms applied in recent rounds, or, for a site with none, its norm in
    this round."""
    out = {}
    for site, values in history.items():
        recent = _recent(values)
        if recent:
            how = f"{site}'s median ‖Δ‖ applied in its last {len(recent)} rounds"
            out[site] = _Scale(statistics.median(recent), how)
    for site, value in norms.items():
        if site not in out:
            out[site] = _Scale(float(value), f"{site}'s ‖Δ‖ this round")
    return out


def screen(
    norms: Mapping[str, float],
    *,
    theta_norm: float,
    history: Mapping[str, Sequence[float]],
    aggregator: str | None = None,
    alone: bool = False,
    factor: float = DEFAULT_OUTLIER_FACTOR,
    max_delta_ratio: float = DEFAULT_MAX_DELTA_RATIO,
) -> Screen:
    """The norm bounds a contribution must keep. `norms`: site -> ‖Δ‖ of this round's contributions; `history`:
    site -> the norms applied (after cuts) in the last HISTORY_ROUNDS published rounds, every site's;
    `aggregator`: the aggregator's own site; `alone`: the training has this one site only.

    - refused, absolute: ‖Δ‖ > max_delta_ratio × max(‖θ(base)‖, 1). H inner steps move weights far (from a
      random start several times their own norm), never 100 times: this catches what would overflow or dwarf
      the model whatever else is known;
    - refused, with 3 or more contributions: `norm_outliers` (factor × the median of the others' this round);
    - then each contribution is compared with its REFERENCE, made of the OTHER sites' norms only: the median,
      over every other site, of that site's scale (the median of its norms applied in the last HISTORY_ROUNDS
      rounds, or its norm in this round when it has none applied). A site's own norms never enter its own
      reference, so no site can raise its own bound, round after round. With no other site's norm known (the
      first round with one contribution) the reference is the seed max(‖θ(base)‖, 1). A training of one site
      has no other site: its own recent norms are its reference (the seed before it has any). Above factor ×
      the reference:
      - a reference made of 2 or more other sites (a median one dishonest site can move at most halfway to its
        own scale with 2, not at all with 3 or more): cut to the bound (scaled down, not refused);
      - a reference of one other site (two sites), or the seed: the two disagree, and norms cannot say which
        one is wrong. The aggregator's own site decides: its contribution is kept as it is, and the other
        site's is held out of the round (refused for it, reason given) when it is above factor × the
        aggregator site's scale, or when the aggregator site's ‖Δ‖ is above factor × the other's ‖Δ‖ in this
        round (this round's claims, so that no past norm of the other's decides about it). Between two other
        sites, the one above is held out; a site alone above the seed is held out too (the aggregator's own is
        kept);
      - a training of one site: cut to the bound.
    Held out and refused contributions neither count toward the quorum nor enter later references.
    """
    if not (math.isfinite(factor) and factor >= 1):
        raise BadInput(f"screen: factor must be a finite number ≥ 1, got {factor}")
    rejected: dict[str, str] = {}
    limit = max_delta_ratio * max(float(theta_norm), 1.0)
    for site, value in norms.items():
        value = float(value)
        if not (math.isfinite(value) and value >= 0):
            rejected[site] = f"‖Δ‖ = {value} is not a finite non-negative number"
        elif value > limit:
            rejected[site] = (
                f"‖Δ‖ = {value:.6g} > {max_delta_ratio:g} × max(‖θ(base)‖ = {theta_norm:.6g}, 1): no round of "
                "inner steps moves the weights that far"
            )
    rest = {s: float(v) for s, v in norms.items() if s not in rejected}
    if len(rest) >= 3:
        rejected |= norm_outliers(rest, factor=factor)
        rest = {s: v for s, v in rest.items() if s not in rejected}
    scales = _scales(rest, {s: v for s, v in history.items() if not alone})
    seed = _Scale(max(float(theta_norm), 1.0), "max(‖θ(base)‖, 1), no other site's norm being known yet")
    held: dict[str, str] = {}
    clipped: dict[str, tuple[float, str]] = {}
    undecided = (
        "with one site to compare with, norms cannot tell which of the two is wrong: the aggregator's own site's "
        "contribution is kept and the other held out of this round"
    )
    for site, value in rest.items():
        others = {o: sc for o, sc in scales.items() if o != site}
        if alone:
            own = _recent(history.get(site, ()))
            how = f"its own median ‖Δ‖ applied in its last {len(own)} rounds (the training's only site)"
            others = {"": _Scale(statistics.median(own), how)} if own else {}
        if site == aggregator and not alone and len(others) < 2:
            # Kept as it is. The other site of the pair is held out when this Δ is over factor × ITS Δ this round:
            # a decision about the other made of this round's claims, never of the other's own past norms.
            other = next(iter(others), None)
            if other in rest and value > factor * rest[other]:
                held[other] = (
                    f"held out: the aggregator's site {site} sent ‖Δ‖ = {value:.6g} > {factor:g} × "
                    f"{rest[other]:.6g}, {other}'s ‖Δ‖ this round; {undecided}"
                )
            continue
        reference = statistics.median(sc.value for sc in others.values()) if others else seed.value
        bound = factor * reference
        if value <= bound:
            continue
        if len(others) >= 2:
            where = f"the median of {', '.join(sc.how for sc in others.values())}"
        else:
            where = next(iter(others.values())).how if others else seed.how
        if alone or len(others) >= 2:
            why = f"‖Δ‖ = {value:.6g} cut to {bound:.6g}: {factor:g} × {reference:.6g}, {where}"
            clipped[site] = (bound / value, why)
            continue
        held[site] = f"held out: ‖Δ‖ = {value:.6g} > {factor:g} × {reference:.6g}, {where}; " + (
            undecided if others else "held out of this round (the aggregator's own site's would be kept)"
        )
    rejected |= held
    return Screen(rejected, {s: c for s, c in clipped.items() if s not in rejected})


def capped_weights(tokens: Mapping[str, int], *, ratio: float = DEFAULT_MAX_WEIGHT_RATIO) -> dict[str, float]:
    """site -> weight for the `mean` rule with tokens weighting. A token count is the site's own claim: each is
    capped at `ratio` × the median of the other sites' counts, so no site can buy more than that share of the
    average by claiming 2^62 tokens. 0 (not reported) counts as 1. One site alone: 1."""
    counts = {s: float(t) if t > 0 else 1.0 for s, t in tokens.items()}
    if len(counts) < 2:
        return dict.fromkeys(counts, 1.0)
    return {s: min(c, ratio * statistics.median(v for o, v in counts.items() if o != s)) for s, c in counts.items()}


def clipped_to_smallest(contributions: Sequence[Mapping[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Each Δ scaled down (never up) to the smallest ‖Δ‖ among them. The `auto` rule with two sites: their
    equal-weight mean then never points against the honest site's Δ (⟨(Δ_h + x)/2, Δ_h⟩ ≥ 0 when ‖x‖ ≤ ‖Δ_h‖),
    so one dishonest site can slow or stall a round, not reverse it or move θ further than an honest round."""
    norms = [l2_norm(d) for d in contributions]
    smallest = min(norms)
    out = []
    for d, n in zip(contributions, norms, strict=True):
        scale = smallest / n if n > smallest else 1.0
        out.append({k: (v.detach().to(torch.float32) * scale) for k, v in d.items()} if scale != 1.0 else dict(d))
    return out


def check_outer_result(theta: Mapping[str, Tensor], momentum: Mapping[str, Tensor]) -> str | None:
    """None when what a round would publish is finite and bounded (every element within MAX_PUBLISHED_ABS);
    otherwise why not. Checked before anything is signed: a finite Δ of 3e38 overflows θ to inf."""
    for what, tensors in (("θ", theta), ("momentum", momentum)):
        for name in sorted(tensors):  # one pass over each tensor: its extremes say finite and within bounds
            t = tensors[name].detach()
            if not t.is_floating_point():
                continue
            ends = _extremes(t)
            if ends is None or -MAX_PUBLISHED_ABS <= ends[0] <= ends[1] <= MAX_PUBLISHED_ABS:
                continue
            problem = check_finite(tensors)
            if problem:
                return f"the outer step's {what} is not finite: {problem}"
            return f"the outer step's {what}: {name} has elements beyond ±{MAX_PUBLISHED_ABS:g}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Aggregation


def aggregate(
    contributions: Sequence[tuple[float, Mapping[str, Tensor]]], rule: str = "mean", trim: float = 0.2
) -> dict[str, Tensor]:
    """Δ̄ (fp32, by name) from (weight, Δ_i) pairs, in the order given. Contributions are assumed checked already
    (`decode`, `check_finite`, `screen`); `OuterStep.apply` refuses a non-finite result.
    - "auto" (the default): as robust as the number of sites allows, weights ignored: one contribution is taken
      as it is; two are averaged equally after `clipped_to_smallest`; three or more take the coordinate-wise
      median;
    - "mean": Σ w_i Δ_i / Σ w_i, accumulated in float64; weights (tokens seen, or all equal) must be finite,
      ≥ 0, and not all 0;
    - "median": the coordinate-wise median; for an even count, the mean of the two middle values (as numpy);
    - "trimmed_mean": per coordinate, drop the k = floor(trim·n) smallest and k largest values and average the
      rest (scipy's trim_mean, as Flower's FedTrimmedAvg): trim 0.2 with fewer than 5 sites drops nothing.
    median and trimmed_mean ignore the weights (as Flower's FedMedian and FedTrimmedAvg do): a weighted median
    would let one site claim a huge token count and win every coordinate. Coordinate-wise median and trimmed
    mean are Yin et al.'s robust rules (arXiv:1803.01498): a minority of sites cannot pull a coordinate beyond
    the honest values.
    """
    if not contributions:
        raise BadInput("aggregate: no contributions")
    if rule not in AGGREGATION_RULES:
        raise BadInput(f"aggregate: unknown rule '{rule}' (one of {', '.join(AGGREGATION_RULES)})")
    weights = [float(w) for w, _ in contributions]
    if not all(math.isfinite(w) and w >= 0 for w in weights) or (rule == "mean" and sum(weights) <= 0):
        raise BadInput(f"aggregate: weights must be finite, ≥ 0 and not all 0, got {weights}")
    if rule == "trimmed_mean" and not (0 <= trim < 0.5):
        raise BadInput(f"aggregate: trim must be in [0, 0.5), got {trim}")
    first = contributions[0][1]
    for i, (_, d) in enumerate(contributions):
        _require_same_shapes(first, d, f"aggregate: contribution {i} against contribution 0")
    n = len(contributions)
    if rule == "auto":
        deltas = [d for _, d in contributions]
        if n >= 3:
            return aggregate([(1.0, d) for d in deltas], rule="median")
        return aggregate([(1.0, d) for d in (clipped_to_smallest(deltas) if n == 2 else deltas)], rule="mean")
    total = sum(weights)
    out = {}
    for name in first:
        if rule == "mean":
            acc = torch.zeros(first[name].shape, dtype=torch.float64, device=first[name].device)
            for w, (_, d) in zip(weights, contributions, strict=True):
                acc.add_(d[name].detach().to(device=acc.device, dtype=torch.float64), alpha=w / total)
            out[name] = acc.to(torch.float32)
            continue
        device = first[name].device
        stacked = torch.stack([d[name].detach().to(device=device, dtype=torch.float32) for _, d in contributions])
        ordered = stacked.sort(dim=0).values  # (n, *shape)
        if rule == "median":
            lower, upper = ordered[(n - 1) // 2], ordered[n // 2]
            out[name] = ((lower.to(torch.float64) + upper.to(torch.float64)) / 2).to(torch.float32)
        else:
            k = math.floor(trim * n)
            out[name] = ordered[k : n - k].to(torch.float64).mean(dim=0).to(torch.float32)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The outer optimizer


class OuterState(NamedTuple):
    """What an aggregator saves (and publishes) after a round: θ and the momentum buffers, fp32, by name.
    momentum_buffers is empty before the first round, and always with μ = 0. A named tuple, so that
    `theta, momentum = outer.state()` reads as the pair it is."""

    theta: dict[str, Tensor]
    momentum_buffers: dict[str, Tensor]


class OuterStep:
    """Global θ (fp32 copies, by name) and torch's SGD over it: Nesterov with μ > 0, plain SGD with μ = 0.

    `momentum_buffers`: the buffers saved by `state()` after an earlier round (restored as torch's
    `momentum_buffer`), or None / {} for a fresh start. All of θ's names or none: a partial set is refused.

    The step is torch's functional SGD (`torch.optim.sgd.sgd`, what `torch.optim.SGD.step` calls with the same
    arguments, so the numbers are the same bits): constructing `torch.optim.SGD` imports torch._dynamo, 1.5 s of
    every aggregating `hpcscale sync` tick here, a fresh process each time under cron.
    """

    def __init__(
        self,
        theta: Mapping[str, Tensor],
        *,
        lr: float = DEFAULT_LR,
        momentum: float = DEFAULT_MOMENTUM,
        momentum_buffers: Mapping[str, Tensor] | None = None,
    ):
        if not (math.isfinite(lr) and lr > 0):
            raise BadInput(f"outer step: lr must be a finite number > 0, got {lr}")
        if not (math.isfinite(momentum) and 0 <= momentum < 1):
            raise BadInput(f"outer step: momentum must be in [0, 1), got {momentum}")
        if not theta:
            raise BadInput("outer step: θ has no tensors")
        _require_same_shapes(theta, theta, "outer step: θ")
        reason = check_finite(theta)
        if reason:
            raise BadInput(f"outer step: θ: {reason}")
        self.lr = lr
        self.momentum = momentum
        # sorted: the parameter order never depends on how the caller built its dict
        self._params = {
            n: theta[n].detach().to(torch.float32).clone(memory_format=torch.contiguous_format) for n in sorted(theta)
        }
        self._buffers: dict[str, Tensor | None] = dict.fromkeys(self._params)
        if momentum_buffers:
            self._restore_buffers(momentum_buffers)

    @classmethod
    def from_state(
        cls,
        theta: Mapping[str, Tensor],
        momentum_buffers: Mapping[str, Tensor] | None,
        *,
        lr: float = DEFAULT_LR,
        momentum: float = DEFAULT_MOMENTUM,
    ) -> OuterStep:
        """The optimizer an aggregator had when `state()` gave (theta, momentum_buffers): it continues
        bit-identically. momentum_buffers None or {}: none saved yet (a fresh start)."""
        return cls(theta, lr=lr, momentum=momentum, momentum_buffers=momentum_buffers)

    def _restore_buffers(self, buffers: Mapping[str, Tensor]) -> None:
        if self.momentum == 0:
            raise BadInput("outer step: momentum buffers given, but momentum is 0 (plain SGD keeps none)")
        _require_same_shapes(self._params, buffers, "outer step: momentum buffers against θ")
        reason = check_finite(buffers)
        if reason:
            raise BadInput(f"outer step: momentum buffers: {reason}")
        for name, p in self._params.items():
            buf = buffers[name].detach().to(device=p.device, dtype=torch.float32)
            self._buffers[name] = buf.clone(memory_format=torch.contiguous_format)

    def apply(self, avg_delta: Mapping[str, Tensor]) -> None:
        """One outer step with Δ̄ as the gradient: θ ← SGD(θ, Δ̄). Δ̄ must have θ's names and shapes, and be finite."""
        from torch.optim.sgd import sgd

        _require_same_shapes(self._params, avg_delta, "outer step: Δ̄ against θ")
        reason = check_finite(avg_delta)
        if reason:
            raise BadInput(f"outer step: Δ̄: {reason}")
        names = list(self._params)
        grads = [avg_delta[n].detach().to(device=self._params[n].device, dtype=torch.float32) for n in names]
        buffers = [self._buffers[n] for n in names]
        with torch.no_grad():  # SGD.step's own context; never writes into the gradient (a first buffer is a clone)
            sgd(
                [self._params[n] for n in names],
                grads,
                buffers,
                weight_decay=0.0,
                momentum=self.momentum,
                lr=self.lr,
                dampening=0.0,
                nesterov=self.momentum > 0,
                maximize=False,
                foreach=False,
            )
        if self.momentum > 0:  # the functional step fills a first buffer into the list it is given
            self._buffers = dict(zip(names, buffers, strict=True))

    def state(self) -> OuterState:
        """Copies of θ and of the momentum buffers (empty before the first step and with μ = 0)."""
        theta = {n: p.detach().clone() for n, p in self._params.items()}
        buffers = {n: b.detach().clone() for n, b in self._buffers.items() if b is not None}
        return OuterState(theta, buffers)


# ---------------------------------------------------------------------------------------------------------------
# Whole rounds, in process


def reference_rounds(
    theta0: Mapping[str, Tensor],
    site_fns: Sequence[Callable[[dict[str, Tensor]], Mapping[str, Tensor]]],
    rounds: int,
    *,
    lr: float = DEFAULT_LR,
    momentum: float = DEFAULT_MOMENTUM,
    weights: Sequence[float] | None = None,
    encoding: str = "fp32",
    rule: str = "mean",
) -> list[dict[str, Tensor]]:
    """θ after each of `rounds` rounds: every site function gets a copy of θ(r−1) and returns its θ_i; each
    Δ_i goes through `encode`/`decode` as on the wire, then `aggregate` (weights None: equal) and `OuterStep`."""
    if weights is None:
        weights = [1.0] * len(site_fns)
    if len(weights) != len(site_fns):
        raise BadInput(f"reference_rounds: {len(weights)} weights for {len(site_fns)} sites")
    outer = OuterStep(theta0, lr=lr, momentum=momentum)
    shapes = shapes_of(theta0)
    history = []
    for _ in range(rounds):
        start = outer.state().theta
        contributions = []
        for fn, weight in zip(site_fns, weights, strict=True):
            local = fn({n: t.clone() for n, t in start.items()})
            contributions.append((weight, decode(encode(delta(start, local), encoding), encoding, shapes)))
        outer.apply(aggregate(contributions, rule=rule))
        history.append(outer.state().theta)
    return history

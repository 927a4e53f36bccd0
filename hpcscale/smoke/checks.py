"""`hpcscale smoke`: the first thing a site runs on new GPU nodes. Each check is a real job of its own, run the
way users run theirs (sbatch and srun on a Slurm site, mpirun with --local), and judged from what it left in its
run directory:

1. devices: each rank's device, GPU UUID, CPUs and NUMA nodes (a rank whose CPUs are not on its GPU's NUMA node
   fails `binding`), and an all-reduce over every rank, checked and timed (bus bandwidth);
2. layout: the reference GPT at tp x pp x dp for a few steps, with what GPU jobs run by default (fused AdamW;
   bf16 on GPUs, whose pipeline stages then send bf16; the dp ranks sharded with FSDP2 when dp > 1, as HSDP
   in replica pairs from dp = 4), its losses and gradient norms against the same job at tp = pp = 1 (every rank
   data-parallel, replicated): equal to 1e-5 in fp32 on the CPU; within BF16_TOLERANCE on GPUs, where bf16
   rounds differently per layout. A wrong gradient scale or a missing reduction moves the gradient norm by a
   factor, far outside either;
3. traffic: the layout run's communication ledger, bytes per step in each process group;
4. checkpoint: the layout run's mid-run save, asynchronous (copied out of GPU memory on the writer thread's own
   stream), verified chunk by chunk (`hpcscale ckpt verify`);
5. resume: the same job stopped at that step (its second save, not its first: a process's later saves are the
   ones that must not keep stale optimizer state) and resumed gives the uninterrupted run's losses bit for bit
   (deterministic kernels);
6. nccl-timeout: one rank never joins a collective; NCCL's watchdog aborts the others after timeout_seconds,
   and the diagnosis `hpcscale resume --dry-run` shows names the late rank and its node. NCCL only: on the CPU
   (gloo) it is skipped, and the report says so.

Everything here is torch-free: the checks read JSON the ranks wrote (hpcscale.smoke.probe, RUN/metrics.jsonl).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from hpcscale.ckpt.format import LATEST, step_dir_name, step_of
from hpcscale.ckpt.ops import verify
from hpcscale.config.load import resolve_site
from hpcscale.errors import BadInput
from hpcscale.layout import JobLayout
from hpcscale.observe.timing import read_windows, traffic
from hpcscale.recovery.resume import plan_resume
from hpcscale.rundir import ATTEMPTS, CHECKPOINTS, LOGS, METRICS, OWNER, RUN_ID, TIMING, RunDir
from hpcscale.smoke.probe import SMOKE_DIR
from hpcscale.util.bounded import read_bounded, read_tail
from hpcscale.util.trust import private_dir

BF16_TOLERANCE = 0.03  # relative, per step: bf16 layouts agree to about 1e-2 over a short run
FP32_TOLERANCE = 1e-5  # relative, per step: the layout guarantee (tests/training/test_train_layouts.py)
TIMEOUT_S = 20  # the forced timeout's collective timeout (the job spec's minimum is 10)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Literal["pass", "fail", "skip"]
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SmokeReport:
    where: str  # "local" or the site's name
    device: str  # "cuda" or "cpu", as the ranks found it
    layout: dict[str, int]
    run_dir: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How one smoke job ended: its exit code (or Slurm state) and where its output is."""

    run_dir: Path
    ok: bool
    how: str  # "exit 0", "COMPLETED", "FAILED 1:0", ...


@dataclass(frozen=True, slots=True)
class SmokePlan:
    """What the smoke jobs ask for: the site (a name or a file), the allocation and the layout."""

    site: str
    local: bool
    layout: JobLayout  # nodes x tasks per node, tp and pp (validated by hpcscale.layout)
    gpus_per_node: int
    cpus_per_task: int
    partition: str | None
    steps: int
    gpu: bool  # whether the ranks are expected on GPUs (sizes the model and the all-reduce)
    min_busbw_gbps: float | None = None  # the all-reduce fails below this bus bandwidth (None: reported only)

    @property
    def dp_shard(self) -> int:
        """How the layout run shards its dp ranks: all of them (FSDP) up to 3, in halves (HSDP, two replicas)
        from 4 when dp is even, none at dp = 1."""
        dp = self.layout.dp
        return dp // 2 if dp >= 4 and dp % 2 == 0 else dp

    def spec(
        self, name: str, *, entry: str, params: dict, tp: int = 1, pp: int = 1, dp_shard: int = 1, **extra: Any
    ) -> dict:
        """A job spec for one smoke job."""
        spec: dict[str, Any] = {
            "name": f"smoke-{name}",
            "site": self.site,
            "nodes": self.layout.nodes,
            "tasks_per_node": self.layout.tasks_per_node,
            "parallel": {"tp": tp, "pp": pp, **({"dp_shard": dp_shard} if dp_shard > 1 else {})},
            "timeout_seconds": 120,
            "hang_timeout_seconds": 60,
            "signals": {"requeue": False},
            "train": {"entry": entry, "params": params},
            **extra,
        }
        if self.gpu:  # never a silent CPU run on a GPU machine (a CPU build of torch, a hidden GPU)
            spec["device"] = "cuda"
        if not self.local:
            spec |= {"gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task, "time_limit": "00:20:00"}
            if self.partition:
                spec["partition"] = self.partition
        return spec

    def trainer_params(self) -> dict:
        """The reference GPT, small: a fixed global batch every layout divides (world x 2 samples), enough
        micro-batches for every pipeline stage, and heads for any tp up to 8."""
        base = {"steps": self.steps, "global_batch": self.layout.world * 2, "micro_batch": 2, "log_every": 1}
        base |= {"eval_every": 0, "seed": 11, "warmup_steps": 2, "deterministic": True, "fused_optimizer": True}
        if self.gpu:
            return base | {"seq_len": 128, "n_layer": 2 * self.layout.pp, "n_embd": 512, "n_head": 8, "bf16": True}
        return base | {"seq_len": 32, "n_layer": max(4, self.layout.pp), "n_embd": 32, "n_head": 4}


def check_steps(steps: int) -> None:
    if steps < 4 or steps % 2:
        raise BadInput(f"--steps {steps}: an even number of at least 4 (the resume check stops halfway)")


Runner = Callable[[str, dict, Path, bool], JobOutcome]  # (name, spec, run_dir, reuse) -> outcome


def run_smoke(plan: SmokePlan, root: Path, run: Runner, *, say: Callable[[str], None] = print) -> SmokeReport:
    """Every check in order; a check whose job failed fails, and the ones that need its output say why."""
    check_steps(plan.steps)
    lay = plan.layout
    # the smoke jobs' run directories and specs go here: made by this user, or one of theirs that no one else can
    # write (someone else's, made first, could hold the specs the jobs are loaded from and the reports judged)
    private_dir(root, mode=0o755, what="smoke test's directory")
    report = SmokeReport(
        "local" if plan.local else plan.site,
        "?",
        {"nodes": lay.nodes, "tasks_per_node": lay.tasks_per_node, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp},
        str(root),
    )

    def job(name: str, spec: dict, *, reuse: bool = False, where: str | None = None) -> JobOutcome:
        say(f"hpcscale smoke: {name} ...")
        return run(name, spec, root / (where or name), reuse)

    devices = job("devices", plan.spec("devices", entry="hpcscale.smoke.probe:devices", params={}))
    report.checks += device_checks(devices, plan)
    report.device = "cuda" if any(c.figures.get("gpu") for c in report.checks if c.name == "devices") else "cpu"
    gpu = report.device == "cuda"

    params = plan.trainer_params()
    half = plan.steps // 2
    every = half // 2 if half % 2 == 0 else 1  # half is the second save or a later one
    ckpt = {"every_steps": every, "async": True, "keep_last": plan.steps}
    ledger = {"timing_every": every}  # a window of the ledger closes before the end
    reference = job("reference", plan.spec("reference", entry="builtin", params=params))
    layout_spec = plan.spec(
        "layout",
        entry="builtin",
        params=params,
        tp=lay.tp,
        pp=lay.pp,
        dp_shard=plan.dp_shard,
        checkpoint=ckpt,
        metrics=ledger,
    )
    layout = job("layout", layout_spec)
    report.checks.append(compare_layout(reference, layout, gpu=gpu))
    report.checks.append(traffic_check(layout, plan))
    report.checks.append(verify_checkpoint(layout, half))
    resumed = None
    if layout.ok:  # the layout run as if it had stopped after its mid-run (asynchronous) save
        stopped_at(layout.run_dir, root / "resume", half)
        resumed = job("resume", layout_spec, reuse=True)
    report.checks.append(compare_resume(layout, resumed, half))
    if gpu:
        spec = plan.spec("timeout", entry="hpcscale.smoke.probe:stall", params={})
        spec |= {"timeout_seconds": TIMEOUT_S, "hang_timeout_seconds": 3600}
        report.checks.append(diagnose_timeout(job("nccl-timeout", spec, where="timeout"), plan))
    else:
        report.checks.append(
            Check("nccl-timeout", "skip", "needs NCCL: on gloo a timed-out collective raises in Python instead")
        )
    return report


RANK_REPORT_MAX = 1 << 20  # RUN/smoke/rank-N.json: a few KB each
METRICS_TAIL = 8 << 20  # the end of a smoke job's metrics.jsonl read (a smoke run logs a few hundred steps)


# ---- judging each job -----------------------------------------------------------------------------------------


def _rank_reports(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / SMOKE_DIR).glob("rank-*.json")):
        try:  # a rank's report is a few KB: a FIFO, a device or a larger file there is no report of ours
            out.append(json.loads(read_bounded(path, max_bytes=RANK_REPORT_MAX, what="rank report")))
        except (BadInput, ValueError, RecursionError):
            continue
    return out


def device_checks(outcome: JobOutcome, plan: SmokePlan) -> list[Check]:
    """devices, binding and allreduce, from each rank's report."""
    ranks = _rank_reports(outcome.run_dir)
    if not outcome.ok or len(ranks) != plan.layout.world:
        why = (
            f"the probe job ended {outcome.how}; {len(ranks)} of {plan.layout.world} ranks reported ({outcome.run_dir})"
        )
        return [Check("devices", "fail", why), Check("binding", "skip", "no report"), Check("allreduce", "skip", why)]
    gpus = [r["gpu"] for r in ranks if r.get("gpu")]
    devices = sorted({f"{r['node']}:{r['device']}" for r in ranks})
    if plan.gpu and len(gpus) != len(ranks):
        cpu = [r["rank"] for r in ranks if not r.get("gpu")]
        why = f"GPUs expected, but rank(s) {cpu[:8]} run on the CPU"
        return [Check("devices", "fail", why), Check("binding", "skip", why), Check("allreduce", "skip", why)]
    if gpus:
        names = sorted({g["name"] for g in gpus})
        dev = Check(
            "devices",
            "pass",
            f"{len(ranks)} ranks on {len(devices)} GPUs ({', '.join(names)}), backend {ranks[0]['backend']}, "
            f"CUDA {ranks[0]['cuda']}, NCCL {ranks[0]['nccl']}",
            {"gpu": True, "ranks": ranks},
        )
    else:
        dev = Check(
            "devices",
            "pass",
            f"{len(ranks)} ranks on the CPU, backend {ranks[0]['backend']}",
            {"gpu": False, "ranks": ranks},
        )
    far = [
        f"rank {r['rank']} (CPUs on NUMA {r['cpu_numa_nodes']}, GPU {r['gpu']['index']} "
        f"on NUMA {r['gpu']['numa_node']})"
        for r in ranks
        if r.get("gpu") and r["gpu"].get("numa_node") is not None and r["cpu_numa_nodes"]
        and r["cpu_numa_nodes"] != [r["gpu"]["numa_node"]]
    ]  # fmt: skip
    threads = ", ".join(sorted({str(r.get("omp_num_threads")) for r in ranks}))
    if far:  # an unbound rank's CPUs span every NUMA node: that fails too
        binding = Check("binding", "fail", "not bound to their GPU's NUMA node alone: " + "; ".join(far[:4]))
    elif gpus and all(g.get("numa_node") is not None for g in gpus):
        binding = Check("binding", "pass", f"every rank's CPUs on its GPU's NUMA node alone; OMP_NUM_THREADS {threads}")
    else:
        binding = Check("binding", "skip", f"NUMA placement not known here; OMP_NUM_THREADS {threads}")
    ar = [r["allreduce"] for r in ranks]
    if not all(a["correct"] for a in ar):
        wrong = [r["rank"] for r in ranks if not r["allreduce"]["correct"]]
        allreduce = Check("allreduce", "fail", f"wrong sums on rank(s) {wrong}")
    else:
        slowest = max(a["seconds"] for a in ar)
        bus = min(a["busbw_gbps"] for a in ar)
        detail = (
            f"{ar[0]['bytes'] / 2**20:.0f} MiB over {len(ranks)} ranks: {slowest * 1000:.2f} ms, bus bandwidth "
            f"{bus:.2f} GB/s"
        )
        low = plan.min_busbw_gbps is not None and bus < plan.min_busbw_gbps
        allreduce = Check(
            "allreduce",
            "fail" if low else "pass",
            detail + (f", below --min-busbw {plan.min_busbw_gbps:g}" if low else ""),
            {"bytes": ar[0]["bytes"], "seconds": slowest, "busbw_gbps": bus},
        )
    return [dev, binding, allreduce]


def _metric(run_dir: Path, key: str) -> dict[int, float]:
    """step -> value of `key` in RUN/metrics.jsonl (the last line per step wins: a resumed run repeats none)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    tail = read_tail(path, max_bytes=METRICS_TAIL, what="metrics log", missing_ok=True)  # BadInput: a FIFO
    for line in tail.data.splitlines() if tail else ():
        try:
            row = json.loads(line)  # NaN kept: a diverged loss is what a check must see
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict) and key in row and isinstance(row.get("step"), int):
            out[row["step"]] = row[key]
    return out


def _worst(a: dict[int, float], b: dict[int, float]) -> float:
    if set(a) != set(b) or not a:
        return math.inf
    return max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b)


def compare_layout(reference: JobOutcome, layout: JobOutcome, *, gpu: bool) -> Check:
    if not (reference.ok and layout.ok):
        return Check("layout", "fail", f"reference run {reference.how}, layout run {layout.how} ({layout.run_dir})")
    tolerance = BF16_TOLERANCE if gpu else FP32_TOLERANCE
    losses = _worst(_metric(layout.run_dir, "loss"), _metric(reference.run_dir, "loss"))
    norms = _worst(_metric(layout.run_dir, "grad_norm"), _metric(reference.run_dir, "grad_norm"))
    loss = _metric(layout.run_dir, "loss")
    learns = bool(loss) and all(math.isfinite(v) for v in loss.values()) and loss[max(loss)] < loss[min(loss)]
    figures = {"loss_rel_diff": losses, "grad_norm_rel_diff": norms, "tolerance": tolerance}
    detail = (
        f"losses within {losses:.1e} and gradient norms within {norms:.1e} of tp=pp=1 (tolerance {tolerance:g}"
        + (", bf16" if gpu else ", fp32")
        + ")"
    )
    if losses > tolerance or norms > tolerance:
        return Check("layout", "fail", detail, figures)
    if not learns:
        return Check("layout", "fail", detail + "; but the loss did not fall (or is not finite)", figures)
    return Check("layout", "pass", detail, figures)


def expected_groups(plan: SmokePlan) -> list[str]:
    """The process groups the layout run must send bytes in: each mesh axis it splits."""
    lay, shard = plan.layout, plan.dp_shard
    out = ["mesh_tp"] if lay.tp > 1 else []
    out += ["mesh_pp"] if lay.pp > 1 else []
    if lay.dp > 1:
        out += ["mesh_dp"] if shard == 1 else ["mesh_dp_shard"] + (["mesh_dp_replicate"] if lay.dp > shard else [])
    return out


def traffic_check(layout: JobOutcome, plan: SmokePlan) -> Check:
    """The layout run's bytes per step in each process group, from its newest ledger window (timing.jsonl);
    it fails when a group the layout splits moved nothing (a reduction or a stage's sends missing)."""

    windows = read_windows(layout.run_dir / TIMING) if (layout.run_dir / TIMING).is_file() else []
    groups = traffic(windows[-1]) if windows else []
    if not groups:
        return Check(
            "traffic", "fail", f"no communication ledger in {layout.run_dir / TIMING} (layout run {layout.how})"
        )
    parts = [
        f"{g.group} {g.bytes / 2**20:.2f} MiB ("
        + ", ".join(f"{kind} {k['bytes'] / 2**20:.2f}" for kind, k in sorted(g.kinds.items()))
        + ")"
        for g in groups
    ]
    figures = {g.group: {"bytes": g.bytes, "kinds": g.kinds, "gbps": g.gbps} for g in groups}
    silent = [name for name in expected_groups(plan) if not figures.get(name, {}).get("bytes")]
    if silent:
        return Check("traffic", "fail", f"nothing sent in {', '.join(silent)}; per step: " + "; ".join(parts), figures)
    return Check("traffic", "pass", "per step: " + "; ".join(parts), figures)


def verify_checkpoint(layout: JobOutcome, step: int) -> Check:
    step_dir = layout.run_dir / "checkpoints" / step_dir_name(step)
    if not (step_dir / "index.h5").is_file():
        return Check("checkpoint", "fail", f"no committed checkpoint at {step_dir} (layout run {layout.how})")
    try:
        report = verify(step_dir)
    except Exception as e:  # a refused index: VerificationFailure, BadInput
        return Check("checkpoint", "fail", f"{step_dir}: {type(e).__name__}: {e}")
    if not report.passed:
        first = report.problems[0]
        return Check("checkpoint", "fail", f"{step_dir}: {len(report.problems)} problem(s), first: {first}")
    return Check(
        "checkpoint",
        "pass",
        f"step {step} (saved asynchronously) verified: {report.ok} chunks, {report.bytes / 2**20:.1f} MiB",
        {"chunks": report.ok, "bytes": report.bytes},
    )


def stopped_at(src: Path, dst: Path, step: int) -> None:
    """A copy of run directory `src` in `dst` as the run was after `step` steps: its recorded spec and
    submissions, and its checkpoints up to that step (copied out of a separate checkpoint root if the site has
    one: never shared), without its metrics, logs or run id (a copy is a run of its own)."""

    skip = {RUN_ID, METRICS, TIMING, ATTEMPTS, LOGS, CHECKPOINTS}
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.name in skip:
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, dst / item.name)
    # dereferenced, without the source run's owner mark: a copy of its own, which the resumed run claims
    shutil.copytree(src / CHECKPOINTS, dst / CHECKPOINTS, symlinks=False, ignore=shutil.ignore_patterns(OWNER))
    for item in (dst / CHECKPOINTS).iterdir():
        later = (s := step_of(item.name)) is not None and s > step
        if later or item.name == LATEST:
            shutil.rmtree(item) if item.is_dir() else item.unlink()


def compare_resume(layout: JobOutcome, resumed: JobOutcome | None, half: int) -> Check:
    if not layout.ok:
        return Check("resume", "fail", f"the uninterrupted run {layout.how}")
    if resumed is None or not resumed.ok:
        return Check("resume", "fail", f"the resumed run {resumed.how if resumed else 'did not start'}")
    restored = _metric(resumed.run_dir, "restored_from")
    losses = _metric(resumed.run_dir, "loss")
    if list(restored.values()) != [half] or not losses or min(losses) != half:
        # a run that refused the checkpoint and started again from step 0 logs the same losses (deterministic):
        # only a load of the mid-run save counts
        return Check("resume", "fail", f"the copy did not resume from step {half} (restored_from: {restored})")
    want = {k: v for k, v in _metric(layout.run_dir, "loss").items() if k >= half}
    got = {k: v for k, v in losses.items() if k >= half}
    if got != want:
        diff = _worst(got, want)
        return Check("resume", "fail", f"steps {half}+ after the resume differ from the uninterrupted run ({diff:.1e})")
    return Check("resume", "pass", f"resumed at step {half}: {len(got)} losses bit for bit the uninterrupted run's")


def diagnose_timeout(outcome: JobOutcome, plan: SmokePlan) -> Check:
    """What `resume --dry-run` would say of the forced timeout."""

    late = plan.layout.world - 1
    try:
        resume_plan, _ = plan_resume(RunDir(outcome.run_dir))
    except Exception as e:
        return Check("nccl-timeout", "fail", f"resume --dry-run refused: {type(e).__name__}: {e}")
    said = resume_plan.diagnosis.rank_failure or resume_plan.diagnosis.explanation
    figures = {"rank_failure": said, "blamed_nodes": resume_plan.diagnosis.failed_nodes}
    if said and said.startswith("NCCL collective timeout") and f"rank(s) {late}" in said:
        return Check("nccl-timeout", "pass", said, figures)
    return Check("nccl-timeout", "fail", f"the diagnosis does not name rank {late}: {said!r}", figures)


def visible_gpus() -> int:
    """NVIDIA GPUs this machine shows (/dev/nvidiaN), without importing torch (the front end stays light)."""
    import re

    dev = Path("/dev")
    return sum(1 for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name)) if dev.is_dir() else 0


def make_plan(
    *,
    site: str | None,
    local: bool,
    ranks: int | None,
    nodes: int | None,
    partition: str | None,
    tp: int | None,
    pp: int | None,
    steps: int,
    min_busbw_gbps: float | None = None,
) -> SmokePlan:
    """The smoke jobs' allocation and layout. --local: one node, `ranks` ranks (default: one per GPU this
    machine shows, else 4). A Slurm site: `nodes` nodes (default 2) of the partition (default: the site's),
    one rank per GPU (2 per node on CPU partitions), all of each node's cores. tp and pp default to 2 where the
    ranks allow, so all three axes are exercised on 8 ranks or more."""

    if local:
        if nodes not in (None, 1):
            raise BadInput("--nodes: --local runs on this machine, one node")
        gpus = visible_gpus()
        world = ranks or gpus or 4
        n, per_node, gpn, cpt, part, name, gpu = 1, world, 0, 1, None, "local", gpus > 0
    else:
        if ranks is not None:
            raise BadInput("-n: on a Slurm site the ranks are --nodes x the partition's GPUs (or 2 per node)")
        if site is None:
            raise BadInput("--site SITE (a Slurm site), or --local to run on this machine")
        loaded = resolve_site(site)
        config = loaded.config
        if config.scheduler != "slurm":
            raise BadInput(f"site '{config.name}' is not a Slurm site: use --local for this machine")
        chosen = config.partition(partition)
        if chosen is None:
            raise BadInput(f"site '{config.name}' has no partition {partition!r} and no default partition")
        gpn = chosen.gpus_per_node
        per_node = gpn or 2
        n = nodes or 2
        cpt = max(1, chosen.cpus_per_node // per_node)
        part, name, gpu = chosen.name, site, gpn > 0
    world = n * per_node
    if world < 2:
        raise BadInput("the smoke test needs at least 2 ranks: a collective, a layout and a timeout need peers")
    tp = tp or (2 if per_node % 2 == 0 else 1)
    pp = pp or (2 if world % (2 * tp) == 0 and world >= 4 else 1)
    check_steps(steps)
    return SmokePlan(
        site=name,
        local=local,
        layout=JobLayout(nodes=n, tasks_per_node=per_node, tp=tp, pp=pp),
        gpus_per_node=gpn,
        cpus_per_task=cpt,
        partition=part,
        steps=steps,
        gpu=gpu,
        min_busbw_gbps=min_busbw_gbps,
    )

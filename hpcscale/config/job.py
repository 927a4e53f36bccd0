"""Job spec schema: what to run, where and how. Reference: docs/config-reference.md."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from hpcscale.config.fields import setting
from hpcscale.config.site import check_env_names, check_name
from hpcscale.layout import keyed_axes
from hpcscale.util.slurmtime import check_duration

_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def check_job_name(value: str) -> str | None:
    # Any text is a valid name (it is always quoted); control characters would break #SBATCH lines and logs.
    if not value.strip():
        return "must not be blank"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "must not contain control characters (newlines, tabs)"
    if len(value) > 200:
        return "longer than 200 characters"
    return None


def check_entry_point(value: str) -> str | None:
    if value == "builtin" or _ENTRY.match(value):
        return None
    return f"'{value}' is neither 'builtin' nor 'package.module:function'"


@dataclass(kw_only=True, slots=True)
class Parallel:
    """The parallel layout. dp is derived: world size / (tp × pp); it splits into dp_replicate × dp_shard."""

    tp: int = setting(
        "Tensor-parallel degree; groups stay inside a node, so it divides tasks_per_node.", default=1, min=1
    )
    pp: int = setting("Pipeline-parallel degree (stages).", default=1, min=1)
    dp_shard: int = setting(
        "How many data-parallel ranks shard parameters, gradients and optimizer state among them (FSDP2); it "
        "divides dp. 1: every dp rank holds a full replica. dp: fully sharded (ZeRO-3). Between: HSDP, sharded "
        "within groups of dp_shard ranks and replicated across dp / dp_shard groups (docs/large-models.md).",
        default=1,
        min=1,
    )
    reshard_after_forward: bool | Literal["auto"] = setting(
        "With dp_shard > 1: free each block's gathered parameters after its forward and gather them again for "
        "backward (less memory, one more all-gather per block). false keeps them until backward. `auto`: true "
        "at pp = 1; false with pp > 1, where a stage runs every micro-batch's forward before their backwards and "
        "true would gather each block once per micro-batch and again in backward.",
        default="auto",
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = setting(
        "The dtype a model computes in. `bf16` with dp_shard > 1: parameters gathered in bf16, gradients reduced "
        "in fp32, the sharded master copy and optimizer state in fp32; with dp_shard = 1: the forward under "
        "torch.autocast(bf16), parameters, gradients and their all-reduce fp32. Either way the model's output is "
        "fp32. `auto`: bf16 on GPUs, fp32 on CPU (the built-in trainer: bf16 only when its `bf16` param is true).",
        default="auto",
    )
    activation_checkpointing: bool = setting(
        "Recompute each block's activations in backward instead of keeping them (about one more forward of "
        "compute for a block's activations' memory). Applied by ctx.parallelize and the built-in trainer.",
        default=False,
    )

    @property
    def degrees(self) -> dict[str, int]:
        """Each parallel axis' degree by its key (the registry, hpcscale.layout.AXES): what JobLayout and
        ParallelDims.for_world take. An axis registered without a setting here has degree 1."""
        return {a.key: getattr(self, a.key, 1) for a in keyed_axes()}


@dataclass(kw_only=True, slots=True)
class Train:
    """What the ranks run."""

    entry: str = setting(
        "`builtin` (the reference GPT trainer) or your `package.module:function`, called with a Context.",
        default="builtin",
        check=check_entry_point,
    )
    params: dict[str, Any] = setting("Parameters for the entry point (model size, steps, batch, lr...).", factory=dict)
    on_spike: Literal["warn", "rollback", "off"] = setting(
        "What a loss or gradient-norm spike does (docs/observability.md#spikes; judged on the values the loop sums "
        "through ctx.checkpoint.step, as the built-in trainer does): `warn` logs it with the step and the data "
        "position; `rollback` also loads the newest checkpoint and skips the data read since it up to the spike's "
        "batch (the loop must continue from the step ctx.checkpoint.step returns; the data position is a "
        "registered object with a `skip(batches)` method, as the built-in trainer's loader has); `off`.",
        default="warn",
    )


@dataclass(kw_only=True, slots=True)
class NodeLocalTier:
    """Checkpoints on each node's own storage, with partner copies on other nodes (docs/checkpoint-format.md)."""

    every_steps: int | Literal["auto"] = setting(
        "Save to the node-local tier every N steps; 0 (the default) turns the tier off. Independent of "
        "`checkpoint.every_steps`, the shared tier's period: a node-local save is cheap, so it can be frequent. "
        "`auto`: Young/Daly from the node-local saves' own measured cost, as `checkpoint.every_steps: auto` does "
        "for the shared tier. Each shared-tier save is then taken on the node-local tier and drained from there.",
        default=0,
        min=0,
    )
    keep_last: int = setting(
        "Keep the newest K node-local steps on each node; a step counts once its partner copies are made (until "
        "then the node holds K + 1), so a node lost during a save still leaves K whole steps to recover from.",
        default=2,
        min=1,
    )
    partners: int = setting(
        "How many other nodes hold a copy of each node's node-local data (capped at the job's nodes - 1). 0: a "
        "lost node takes its part of every node-local step with it, and recovery falls back to the shared tier.",
        default=1,
        min=0,
    )
    partner_switch: Literal["other", "same"] = setting(
        "Where partners sit in the switch tree. `other`: under another leaf switch, so a switch (or its power) "
        "failing never takes a node and its copies together. `same`: under the same leaf switch: copies cross no "
        "uplink (faster on an oversubscribed tree), but one switch failure can lose both.",
        default="other",
    )


@dataclass(kw_only=True, slots=True)
class CheckpointPolicy:
    """When to checkpoint and what to keep."""

    every_steps: int | Literal["auto"] = setting(
        "Save every N steps; 0 turns periodic saves off. `auto`: the interval that loses the least time to "
        "saves and failures together (Young/Daly, from each save's measured cost and the job's MTBF: the "
        "site's `reliability.node_mtbf_hours` and this run's failures), recomputed at every save "
        "(docs/observability.md).",
        default=100,
        min=0,
    )
    keep_last: int = setting("Keep the newest K checkpoints.", default=3, min=1)
    keep_every: int = setting("Also keep every M-th step's checkpoint; 0 for none.", default=0, min=0)
    asynchronous: bool = setting("Write in the background while training goes on.", default=True, key="async")
    direct_io: bool = setting(
        "Write checkpoint data with O_DIRECT, past the page cache (buffered where the filesystem refuses it).",
        default=True,
    )
    background_nice: int = setting(
        "How much to raise the nice value of the thread that writes async saves, above the rank's own (0: the "
        "loop's priority; 19: the lowest there is: the loop's threads get a core first and the save runs when "
        "they wait, so on a node whose cores are all busy it finishes later) (docs/checkpoint-format.md#async-saves).",
        default=0,
        min=0,
        max=19,
    )
    local: NodeLocalTier = setting(
        "The node-local tier, below the shared one (off unless `local.every_steps` is set).", factory=NodeLocalTier
    )


@dataclass(kw_only=True, slots=True)
class Metrics:
    """What a run records beside metrics.jsonl (docs/observability.md)."""

    timing_every: int = setting(
        "Every N steps, rank 0 gathers each rank's step-time breakdown over those steps (one small MPI gather) "
        "into RUN/timing.jsonl, with the communication ledger (bytes and collectives per process group, how late "
        "each rank arrived at them): what `hpcscale status` names stragglers and shows traffic from. 0 turns it off.",
        default=20,
        min=0,
    )
    tensorboard: bool = setting(
        "Also write rank 0's metrics as TensorBoard event files under RUN/tensorboard/.", default=False
    )
    flops: Literal["count", "formula", "off"] = setting(
        "How the model FLOPs of a step are found for `tflops` and `mfu` (docs/observability.md#efficiency): "
        "`count` runs each attempt's second step under torch's FlopCounterMode (6 x parameters x tokens where it "
        "sees nothing, or the model went through torch.compile); `formula` uses 6 x parameters x "
        "ctx.checkpoint.tokens_per_step alone; `off`: no FLOPs, memory only.",
        default="count",
    )


@dataclass(kw_only=True, slots=True)
class Health:
    """Warning signs Slurm and the GPUs show of a running job, acted on before a failure
    (docs/observability.md#health-signals)."""

    poll_seconds: float = setting(
        "Every N seconds rank 0 asks Slurm (scontrol) about the job's nodes, reservations and time limit, and each "
        "GPU rank its own GPU (health.devices); a new sign is logged once with its evidence and triggers an "
        "immediate node-local checkpoint (with checkpoint.local; logged only without it). 0 turns both off. Slurm "
        "is not asked under `run --local` (no scheduler).",
        default=30.0,
        min=0,
    )
    cooldown_seconds: float = setting(
        "At most one checkpoint per this many seconds for signs: a flapping sign cannot make a save storm.",
        default=600.0,
        min=0,
    )
    stragglers: Literal["warn", "save", "off"] = setting(
        "A rank the straggler rule names (docs/observability.md#the-straggler-rule), judged by rank 0 at each "
        "per-rank timing window: `warn` logs it as a sign (once per rank and attempt); `save` also takes a "
        "node-local checkpoint as for Slurm's signs; `off`. Not `save` by default: a slow rank is not a failing "
        "node, and on shared or oversubscribed nodes the rule names one without any fault. Moving off its node is "
        "`resume --exclude-slow`'s.",
        default="warn",
    )
    warn_before_seconds: float = setting(
        "A reservation that takes one of the job's nodes, or the job's time limit, is a sign this many seconds "
        "before it.",
        default=900.0,
        min=0,
    )
    devices: Literal["save", "warn", "off"] = setting(
        "Each GPU rank reads its own device's signs through NVML (the `nvml` extra) every poll_seconds: "
        "uncorrected ECC errors since the attempt started, a row remapping pending or failed, Xid critical errors, "
        "clocks held down by heat or the power supply. `save` logs each once (rank 0, with the rank and node) and "
        "takes a node-local checkpoint as for Slurm's signs, the node suspect for `resume` and the relaunch "
        "(throttling aside); `warn` logs only; `off`. CPU ranks have none.",
        default="save",
    )


@dataclass(kw_only=True, slots=True)
class ModelSize:
    """The model's size, as placement's traffic model needs it (docs/placement.md): the bytes each kind of group
    exchanges per step follow from it. Declare it for your own entry point; the built-in trainer's comes from its
    `train.params`. Without one, placement uses default ratios."""

    layers: int = setting("Transformer blocks.", min=1)
    hidden: int = setting("Hidden size (the width of the activations the layers pass on).", min=1)
    seq_len: int = setting("Tokens per sample.", min=1)
    micro_batch: int = setting("Samples per micro-batch on one data-parallel rank.", default=1, min=1)
    global_batch: int | None = setting(
        "Samples per optimizer step over all data-parallel ranks; unset: one micro-batch per rank.", default=None, min=1
    )
    vocab: int = setting("Vocabulary size (the embedding's rows).", default=256, min=1)
    parameters: int | None = setting(
        "Parameters of the whole model; unset: 12·layers·hidden² + vocab·hidden (a GPT's).", default=None, min=1
    )


@dataclass(kw_only=True, slots=True)
class XsiteJob:
    """This job is one site's trainer in a cross-site training (docs/cross-site.md)."""

    config: str = setting(
        "The cross-site config file (the one every site's `hpcscale sync` reads); its `round_steps` and "
        "`wait_seconds` set this trainer's rounds. A relative path is read from the job file's directory.",
    )
    site: str = setting("This job's site in that config.", check=check_name)
    start_from: str | None = setting(
        "A checkpoints directory (another run's `checkpoints/`, e.g. a pretraining run's, copied to this site) "
        "whose newest checkpoint that loads this job starts from when its own run has none: the model, the "
        "optimizer state and the step (the learning-rate schedule goes on from there), not the data position "
        "(each site reads its own data). The rounds start at that step. Give every site the same checkpoint: "
        "DiLoCo starts from a pretrained model (docs/cross-site.md). Only read, never written; it must be yours (or "
        "root's) and writable by no one else, its step directories too (exit 2 otherwise). A relative path is "
        "read from the job file's directory.",
        default=None,
    )


@dataclass(kw_only=True, slots=True)
class Data:
    """The training data."""

    manifest: str | None = setting(
        "Path of the dataset manifest (hpcscale data prepare / manifest build). A relative path is read from the "
        "job file's directory (with -p, from the working directory), for local and Slurm runs alike; `~` and "
        "`$VAR` are expanded on the machine that reads it. On a local site the file must exist.",
        default=None,
    )


@dataclass(kw_only=True, slots=True)
class Signals:
    """The time-limit and preemption signal, and requeue from inside the job (docs/runbook.md)."""

    signal: Literal["USR1", "USR2", "TERM"] = setting(
        "Signal Slurm sends to every rank `grace_seconds` before the time limit (`--signal=<sig>@<grace>`, "
        "no `B:`: the ranks get it, the batch shell keeps waiting for them). USR2 by default: NCCL and UCX may "
        "take USR1.",
        default="USR2",
    )
    grace_seconds: int = setting(
        "Seconds before the time limit at which the signal comes: must cover one step and a checkpoint save.",
        default=120,
        min=1,
        max=65535,
    )
    requeue: bool = setting(
        "Requeue the job (`scontrol requeue`) when it stops for its time limit or a preemption, or fails, "
        "within the budgets of `restart:`; also sbatch `--requeue` (Slurm requeues after a node failure).",
        default=True,
    )


MAX_BACKOFF_S = 86400  # a day: a failed job holds its whole allocation idle while it waits


@dataclass(kw_only=True, slots=True)
class Restart:
    """Budgets of automatic requeues from inside the job, and what `hpcscale resume` excludes."""

    max_preemptions: int = setting(
        "Requeues after a preemption (a stop signal well before the time limit).", default=20, min=0
    )
    max_time_limits: int = setting("Requeues after reaching the time limit.", default=5, min=0)
    max_failures: int = setting("Requeues after a failure (a rank crashed, a node died).", default=2, min=0)
    failure_backoff_seconds: int = setting(
        "Seconds a failed job waits (holding its allocation) before it requeues itself, doubled at each further "
        "failure up to `max_backoff_seconds`; Slurm adds its own requeue delay (the credential lifetime, 120 s by "
        "default).",
        default=30,
        min=0,
        max=MAX_BACKOFF_S,
    )
    max_backoff_seconds: int = setting(
        "The longest a failed job waits before it requeues itself, however many failures came before (the doubled "
        "`failure_backoff_seconds` stops here; a `failure_backoff_seconds` above it waits this long from the first "
        "failure).",
        default=600,
        min=0,
        max=MAX_BACKOFF_S,
    )
    max_no_progress: int = setting(
        "Consecutive attempts that end without a new checkpoint (preemptions aside) after which the job is not "
        "requeued again.",
        default=2,
        min=1,
    )
    exclude: Literal["never", "failed", "all-failed"] = setting(
        "Nodes `hpcscale resume` and a requeue after a failure keep the job off: none, those of the last failure, "
        "or every node that failed in this run (a requeue: in this Slurm job).",
        default="failed",
    )
    spare_nodes: int = setting(
        "Nodes allocated beyond `nodes` and kept idle: when a step fails with a node to blame, the batch script "
        "leaves that node out for the rest of the job and starts a new step on the others plus a spare, in the "
        "same allocation, without going back to the queue (docs/runbook.md). Each such relaunch counts against "
        "`max_failures`.",
        default=0,
        min=0,
        max=64,
    )
    shrink: bool = setting(
        "When a step fails with a node to blame and no spare is left for it, start the next step in the same "
        "allocation on fewer nodes instead of requeueing: the most of the remaining nodes the layout and the "
        "built-in trainer's batch rules allow (the data-parallel degree shrinks, the checkpoint is resharded, "
        "global_batch is kept by accumulating more micro-batches). Counts against `max_failures`; when no smaller "
        "layout fits, the job is requeued as without it (docs/runbook.md).",
        default=False,
    )


def check_sweep(params: dict[str, list[Any]]) -> str | None:
    if not params:
        return "needs at least one parameter"
    empty = [k for k, v in params.items() if not v]
    return f"empty value lists: {', '.join(empty)}" if empty else None


@dataclass(kw_only=True, slots=True)
class Container:
    """Run the ranks in a container through pyxis/enroot (`--template container`)."""

    image: str = setting("Image for `srun --container-image`, e.g. `nvcr.io#nvidia/pytorch:24.05-py3`.")
    mounts: list[str] = setting("`SRC:DST[:FLAGS]` mounts; the run directory is always mounted.", factory=list)
    workdir: str | None = setting("Working directory inside the container; default the run directory.", default=None)


@dataclass(kw_only=True, slots=True)
class Sweep:
    """A job-array sweep over the cartesian product of parameter values (`--template array`)."""

    params: dict[str, list[Any]] = setting(
        "Parameter name -> values; array task i runs the i-th combination (last parameter fastest).", check=check_sweep
    )
    max_parallel: int | None = setting("Most array tasks running at once (`--array=...%N`).", default=None, min=1)

    @property
    def size(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n

    def point(self, index: int) -> dict[str, Any]:
        """The parameters array task `index` runs: the index-th combination, last parameter varying fastest
        (itertools.product order), computed without listing the combinations before it."""
        if not 0 <= index < self.size:
            raise IndexError(f"sweep index {index} is outside 0..{self.size - 1}")
        chosen: dict[str, Any] = {}
        for key in reversed(list(self.params)):
            index, i = divmod(index, len(self.params[key]))
            chosen[key] = self.params[key][i]
        return {key: chosen[key] for key in self.params}


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """One training job."""

    name: str = setting("Job name; any text, always quoted.", check=check_job_name)
    site: str = setting("The site to run on (a site_configs name or a path to a site file).")
    partition: str | None = setting("Partition; unset uses the site's default.", default=None, check=check_name)
    nodes: int = setting("Nodes to allocate.", default=1, min=1)
    tasks_per_node: int = setting("Ranks per node (usually one per GPU).", default=1, min=1)
    gpus_per_node: int = setting("GPUs per node to request.", default=0, min=0)
    device: Literal["auto", "cuda", "cpu"] = setting(
        "Where the ranks compute. auto: a GPU (NCCL) when the rank sees one, the CPU (gloo) otherwise; a job "
        "that requests GPUs (gpus_per_node) and whose ranks see none fails at launch instead of training on the "
        "CPU. cuda: GPUs required. cpu: the CPU even where GPUs are present.",
        default="auto",
    )
    cpus_per_task: int = setting("CPU cores per rank; also sets OMP_NUM_THREADS.", default=1, min=1)
    time_limit: str = setting(
        "Slurm time limit (MM, HH:MM:SS, D-HH:MM:SS...).", default="01:00:00", check=check_duration
    )
    account: str | None = setting("Slurm account to charge.", default=None)
    qos: str | None = setting("Slurm QOS.", default=None)
    parallel: Parallel = setting("Parallel layout.", factory=Parallel)
    train: Train | None = setting("The trainer to run; exclusive with `command`.", default=None)
    command: list[str] | None = setting(
        "A plain program to run under srun instead of a trainer, as a list of arguments.", default=None
    )
    container: Container | None = setting("Container to run the ranks in.", default=None)
    sweep: Sweep | None = setting("Job-array sweep.", default=None)
    checkpoint: CheckpointPolicy = setting("Checkpoint policy.", factory=CheckpointPolicy)
    data: Data = setting("Training data.", factory=Data)
    metrics: Metrics = setting("Per-rank timing and TensorBoard.", factory=Metrics)
    health: Health = setting("Warning signs from Slurm that trigger an immediate checkpoint.", factory=Health)
    xsite: XsiteJob | None = setting("Cross-site training: the config and this job's site.", default=None)
    model: ModelSize | None = setting(
        "The model's size, for placement's traffic model (the built-in trainer's comes from train.params).",
        default=None,
    )
    signals: Signals = setting("Time-limit and preemption signal, and requeue.", factory=Signals)
    restart: Restart = setting("Requeue budgets and node exclusion.", factory=Restart)
    timeout_seconds: int = setting(
        "Collective timeout: a rank blocked this long in communication fails the job instead of hanging it.",
        default=300,
        min=10,
    )
    hang_timeout_seconds: int = setting(
        "A rank that finishes no step for this long (or 10× its longest step so far, whichever is longer; "
        "checkpoint saves and evaluation excepted) ends the job, naming the stuck rank and writing every live "
        "rank's Python stacks to the log.",
        default=120,
        min=5,
    )
    environment: dict[str, str] = setting(
        "Extra variables exported for this job (after the site's).", factory=dict, check=check_env_names
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def dp(self) -> int:
        return self.world_size // (self.parallel.tp * self.parallel.pp)

"""The Context: everything an entry point gets from hpcscale. This is the public API (docs/context-api.md).

def main(ctx: hpcscale.launch.context.Context) -> None:
    model = ...on ctx.device...
    for step in range(ctx.params["steps"]):
        ...
        ctx.metrics.log(step=step, loss=loss)
        if ctx.should_stop():       # a collective: every rank must call it at the same point
            break
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcscale.config.job import JobSpec
from hpcscale.errors import BadInput
from hpcscale.launch.metrics import MetricsLogger
from hpcscale.launch.signals import StopFlag
from hpcscale.layout import ParallelDims
from hpcscale.util.paths import expand_path

# the public API (docs/context-api.md, docs/huggingface.md, docs/checkpoint-format.md): what user code imports
__all__ = ["Context", "MetricsLogger", "Runtime"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    """What `hpcscale launch` found for this attempt before the entry point started, fixed until it ends: read by
    the Context's parts (the step loop, the checkpoint tiers, per-rank timing) as `ctx.runtime`."""

    node_local: Path | None = None  # this node's root of the node-local checkpoint tier (checkpoint.local), or None
    # (each allocated node's leaf switch, the leaves' order), read once by rank 0 at placement (launch/main.py):
    # the node-local tier places its partner copies by it; None on one node or when the tree could not be read
    switches: Any = None
    mtbf_s: float | None = None  # the job's MTBF, for checkpoint intervals of `auto` (observe/interval.py)
    # every collective wait of the training thread (hpcscale.launch.waits), when per-rank timing is on
    waits: Any = None
    # the site's devices.peak_tflops (device name -> peak dense TFLOPS): what MFU is measured against
    peak_tflops: dict[str, float] = field(default_factory=dict)
    # the job's warning signs (launch/health.py): rank 0's polls Slurm; every rank's takes its own GPU's signs
    health: Any = None
    # the MPI rank of global rank 0 (launch.bootstrap.RankInfo.root_mpi): the root of the MPI gathers whose
    # result global rank 0 writes (the timing windows, the GPUs' warning signs)
    root_mpi: int = 0


@dataclass(kw_only=True)
class Context:
    rank: int  # global rank in placement order (tp fastest, then dp, then pp)
    world_size: int
    local_rank: int
    node: str
    dims: ParallelDims
    pp_rank: int
    dp_rank: int
    tp_rank: int
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh with dims ctx.dims.mesh_axes (hpcscale.layout.AXES)
    device: Any  # torch.device: the rank's GPU (launch.bootstrap.choose_gpu), or cpu
    backend: str  # "nccl" or "gloo"
    run_dir: Path
    job: JobSpec
    params: dict[str, Any]  # train.params, with this array task's sweep values applied
    metrics: MetricsLogger
    stop: StopFlag
    sweep_point: dict[str, Any] = field(default_factory=dict)
    scratch: Path | None = None  # the site's scratch directory
    run_id: str | None = None  # the run directory's id (RUN/run-id): its checkpoints carry it as their owner
    runtime: Runtime = field(default_factory=Runtime)  # what launch found for this attempt (Runtime)
    watchdog: Any = None  # the rank's hang watchdog (launch/watchdog.py): .beat(step), .paused(reason)
    step_times: Any = None  # per-rank step times (launch/timing.StepTimes): .record(step, step_s=..., ...)
    _syncs: list[Any] = field(default_factory=list, repr=False)
    _forgotten_wait_s: float = field(default=0.0, repr=False)  # the gradient-sync waits of models forgotten
    # seconds this rank spent in the step's collectives that hpcscale makes for it (clip_grad_norm_'s all-reduces,
    # the reference trainer's loss all-reduce): waiting for peers, which per-rank timing counts as sync
    collective_s: float = 0.0
    _pp_group: Any = field(default=None, repr=False)  # mesh["pp"]'s group, looked up once (slicing the mesh reads it)
    _checkpoint: Any = field(default=None, repr=False)
    _models: list[Any] = field(default_factory=list, repr=False)  # ctx.parallelize's; _syncs[i] is _models[i]'s
    # per model (id) given to ctx.parallelize: its ties across pipeline stages, (parameter, group of the stages
    # holding a copy) each; ctx.pipeline sums their gradients after each step (hpcscale.parallel.ties)
    _stage_ties: dict[int, list[Any]] = field(default_factory=dict, repr=False)
    # id()s of tied parameters whose gradient a lower stage counts in the global norm (clip_grad_norm_)
    _norm_skip: set[int] = field(default_factory=set, repr=False)
    # at parallel.tp > 1: the once-only check that what tp leaves whole gets one gradient (parallel.tp_grads)
    _tp_grads: Any = field(default=None, repr=False)

    @property
    def hooks(self) -> dict[str, Any]:
        """Deprecated (entry points written for hpcscale 0.1): {"watchdog", "timing", "checkpoint"} as a dict, read
        only. Use ctx.watchdog, ctx.step_times and ctx.checkpoint.manager."""
        import warnings

        warnings.warn(
            "ctx.hooks is deprecated: use ctx.watchdog, ctx.step_times and ctx.checkpoint.manager",
            DeprecationWarning,
            stacklevel=2,
        )
        out = {"watchdog": self.watchdog, "timing": self.step_times}
        if self._checkpoint is not None and self._checkpoint._manager is not None:
            out["checkpoint"] = self._checkpoint._manager
        return out

    @property
    def models(self) -> tuple[Any, ...]:
        """The models given to ctx.parallelize, in order, that are still registered (`forget` drops one): what
        clip_grad_norm_, no_sync and accumulate act on by default."""
        return tuple(self._models)

    @property
    def grad_sync_wait_s(self) -> float:
        """Seconds this rank's data-parallel gradient averaging (every registered model's) has waited on the
        network since the start; per-rank timing and the trainer's comm_share take differences of it. 0 without
        replicated data parallelism (FSDP's reduce-scatters are timed as collective waits instead)."""
        return self._forgotten_wait_s + sum(getattr(s, "comm_wait_total_s", 0.0) for s in self._syncs)

    def forget(self, model: Any) -> None:
        """Drop `model` (given to ctx.parallelize) from everything the Context keeps of it: its gradient averaging
        (and the gradient-sized buffers it holds), its ties' stage groups, its tied copies' share of the norm, its
        first-step tensor-parallel check. After this nothing of hpcscale's holds the model, so it can be freed, and
        a model built again and given to ctx.parallelize replaces it. `ctx.checkpoint.restore` does this for the
        model it restored into before it calls `rebuild`. A model that was not given: BadInput. Local: no
        collective."""
        placed = [i for i, m in enumerate(self._models) if m is model]
        if not placed:
            raise BadInput("ctx.forget: this model was not given to ctx.parallelize (or was forgotten already)")
        i = placed[0]
        # its waits stay counted: per-rank timing takes differences of grad_sync_wait_s, which must never go back
        self._forgotten_wait_s += getattr(self._syncs[i], "comm_wait_total_s", 0.0)
        del self._models[i], self._syncs[i]
        for param, _group in self._stage_ties.pop(id(model), []):
            self._norm_skip.discard(id(param))
        if self._tp_grads is not None:
            self._tp_grads.forget(model)

    def parallelize(
        self,
        model: Any,
        *,
        tp_plan: dict[str, Any] | None = None,
        bucket_mb: float = 25.0,
        blocks: Any = None,
        mixed_precision: str | None = None,
        init: Any = None,
        seed: int = 0,
    ) -> Any:
        """Move `model` to this rank's device, apply `tp_plan` over the tp dimension (when parallel.tp > 1), make the
        data-parallel replicas identical and then either average its gradients over them (parallel.dp_shard
        = 1: at the end of every backward, or with parallel.pp > 1 around each step of `ctx.pipeline`) or
        shard it with FSDP2 (dp_shard > 1: per block of `blocks`, given as a module class, submodule names
        or the modules, by default the entries of the model's `layers`; then the root), with the job's
        parallel.reshard_after_forward, activation_checkpointing and mixed_precision (`mixed_precision`
        overrides the last). In place: returns the same model, with the same parameter names
        (hpcscale.parallel.data_parallel says why not DDP). With parallel.pp > 1 the model is this rank's
        pipeline stage (cut_stage); run its steps through `ctx.pipeline`. At parallel.tp > 1 the first step of
        each torch.optim optimizer over its parameters compares, once, the gradients of those the plan leaves whole
        across the tp group: BadInput if any differ (computed on each tp rank's own share of an activation;
        hpcscale.parallel.tp_grads).

        A model built under `torch.device("meta")` is placed without storage and then materialized: each rank
        allocates and initializes only its own shards (hpcscale.parallel.init), running every module's
        reset_parameters() and then `init(module)`, with torch's RNG seeded from `seed` and the module's name,
        so every layout starts from the weights hpcscale.parallel.init.initialize gives the model built whole."""
        # lazy: parallel/ imports torch; importing the Context needs no torch
        from hpcscale.parallel.data_parallel import parallelize
        from hpcscale.parallel.fsdp import ShardedSync, resolve_reshard, shard_model
        from hpcscale.parallel.grad_sync import GradSync
        from hpcscale.parallel.init import materialize, on_meta

        if mixed_precision not in (None, "bf16", "fp32", "auto"):
            raise BadInput(f"ctx.parallelize: mixed_precision is {mixed_precision!r}, not one of bf16, fp32, auto")
        if any(m is model for m in self._models):
            raise BadInput("ctx.parallelize: this model was already parallelized")
        meta = on_meta(model)
        if init is not None and not meta:
            raise BadInput(
                "ctx.parallelize: init= initializes a model built on the meta device; this one has its weights "
                "already (build it under torch.device('meta'), or drop init=)"
            )
        if init is not None and not callable(init):
            raise BadInput(f"ctx.parallelize: init is {init!r}, not a function of one module")
        p = self.job.parallel
        dp_group = self.mesh["dp"].get_group() if self.dims.dp > 1 else None
        if not meta and self.dims.tp == 1:  # with tp, parallelize moves each parameter after slicing it
            model.to(self.device)
        # replicated data parallelism: automatic at the end of each backward, except a pipeline stage's, whose
        # micro-batch backward passes run inside the schedule: ctx.pipeline arms and finishes it per step
        automatic = self.dims.pp == 1

        def shard(m: Any) -> Any:
            shard_model(
                m,
                mesh=self.mesh,
                dims=self.dims,
                device=self.device,
                blocks=blocks,
                reshard_after_forward=resolve_reshard(p.reshard_after_forward, pp=self.dims.pp),
                mixed_precision=mixed_precision or p.mixed_precision,
                activation_checkpointing=p.activation_checkpointing,
                last_stage=self.pp_rank == self.dims.pp - 1,
            )
            if meta:
                materialize(m, init, seed=seed, device=self.device)
            if self.dims.sharded:
                return ShardedSync(m, replicas=self.dims.dp_replicate, pipeline=self.dims.pp > 1)
            return GradSync(m, dp_group, bucket_mb=bucket_mb, automatic=automatic)

        sync = parallelize(
            model, dp_group=dp_group, tp_mesh=self.mesh["tp"], tp_plan=tp_plan, shard=shard, device=self.device
        )
        self._models.append(model)
        self._syncs.append(sync)
        if self.dims.tp > 1:
            if self._tp_grads is None:
                # lazy: parallel/ imports torch; importing the Context needs no torch
                from hpcscale.parallel.tp_grads import TpGradCheck

                self._tp_grads = TpGradCheck(group=self.mesh["tp"].get_group(), device=self.device, tp=self.dims.tp)
            self._tp_grads.watch(model)
        self._stage_ties[id(model)] = self._tie_stages(model)
        return model

    def _tie_stages(self, model: Any) -> list[Any]:
        """The ties cut_stage found across stages in `model` (this rank's stage): each copy this stage holds gets
        the whole model's initial value (broadcast from the stage whose module initializes it last) and a group of
        the stages holding a copy at this rank's dp and tp position, over which ctx.pipeline sums its gradient.
        Collective over those stages' ranks, in the same order on each (the ties' order, the same on all)."""
        import torch
        import torch.distributed as dist

        # lazy: parallel/ imports torch; importing the Context needs no torch
        from hpcscale.parallel.ties import STAGE_TIES

        ties = model.__dict__.get(STAGE_TIES) or []
        if not ties or self.dims.pp == 1:
            return []
        pp_ranks = self.mesh["pp"].mesh.tolist()  # the global ranks of this rank's pipeline, by stage
        out = []
        for tie in ties:
            if self.pp_rank not in tie.stages or tie.here is None:
                continue
            if len(tie.stages) == self.dims.pp:
                group = self.mesh["pp"].get_group()
            else:  # only the member ranks take part (use_local_synchronization): the others hold no copy
                group = dist.new_group([pp_ranks[s] for s in tie.stages], use_local_synchronization=True)
            param = model.get_parameter(tie.here)
            local = param.to_local() if hasattr(param, "to_local") else param
            with torch.no_grad():
                dist.broadcast(local, group=group, group_src=tie.stages.index(tie.init_stage))
            if self.pp_rank != tie.stages[0]:
                self._norm_skip.add(id(param))
            out.append((param, group))
        return out

    def pipeline(self, stage: Any, *, n_microbatches: int, loss_fn: Any, schedule: str = "1f1b") -> Any:
        """torch's pipeline schedule (`1f1b` or `gpipe`) for this rank's stage, after `ctx.parallelize(stage)`:
        a hpcscale.parallel.pipeline.Pipeline, whose `step(inputs, targets)` runs one step's micro-batches
        forward and backward with the data-parallel gradient averaging around them and returns the step's mean
        loss on the last stage (`first`/`last` say which stage takes the inputs and which the targets).
        `loss_fn(output, target)` is the loss of one micro-batch; it is divided by n_microbatches for you."""
        # lazy: parallel/ imports torch; importing the Context needs no torch
        from hpcscale.parallel.pipeline import SCHEDULES, Pipeline, build_schedule

        if self.dims.pp == 1:
            raise BadInput("ctx.pipeline: parallel.pp is 1; call the model directly")
        if schedule not in SCHEDULES:
            raise BadInput(f"ctx.pipeline: schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
        if n_microbatches < 1:
            raise BadInput(f"ctx.pipeline: n_microbatches is {n_microbatches}; it must be at least 1")
        if schedule == "1f1b" and n_microbatches < self.dims.pp:
            raise BadInput(
                f"ctx.pipeline: n_microbatches is {n_microbatches}, fewer than parallel.pp = {self.dims.pp}: "
                "1F1B needs at least one micro-batch per stage"
            )
        placed = [i for i, m in enumerate(self._models) if m is stage]
        if not placed:
            raise BadInput("ctx.pipeline: call ctx.parallelize(stage) first (it places the stage and its replicas)")
        built = build_schedule(
            stage,
            pp_mesh=self.mesh["pp"],
            n_microbatches=n_microbatches,
            kind=schedule,
            loss_fn=loss_fn,
            device=self.device,
        )
        return Pipeline(
            built,
            [self._syncs[placed[0]]],
            ties=self._stage_ties.get(id(stage), []),
            n_microbatches=n_microbatches,
            first=self.pp_rank == 0,
            last=self.pp_rank == self.dims.pp - 1,
        )

    def clip_grad_norm_(self, max_norm: float, parameters: Any = None) -> Any:
        """Clip the gradients to a global norm of `max_norm` (0: measure only) and return the norm before
        clipping: the norm of the whole model's gradient, as one process training it would compute, under
        every layout (tensor-parallel and FSDP shards summed over their groups, pipeline stages summed,
        replicas counted once; hpcscale.parallel.clip), as a 0-dim fp64 tensor on the rank's device, the same
        on every rank, as torch's clip_grad_norm_ returns it: nothing waits for it until it is read (float(norm),
        ctx.metrics.log). `parameters`: by default those of every model given to ctx.parallelize.
        torch.nn.utils.clip_grad_norm_ takes a tp-sharded model's norm wrongly or raises (`mixed torch.Tensor and
        DTensor`). A collective: call it in every rank, after backward."""
        # lazy: parallel/ imports torch; importing the Context needs no torch
        from hpcscale.parallel.clip import clip_grad_norm

        if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm >= 0:
            raise BadInput(f"ctx.clip_grad_norm_: max_norm is {max_norm!r}; a number >= 0 (0 or inf: measure only)")
        if parameters is None:
            parameters = [q for m in self._models for q in m.parameters()]
        params = [q for q in parameters if q.requires_grad]
        if self._pp_group is None and self.dims.pp > 1:
            self._pp_group = self.mesh["pp"].get_group()
        pp_group = self._pp_group
        # timing the all-reduces needs the stream settled around them: on CPU that costs nothing; on a GPU it would
        # be two waits for the device each step, and per-rank timing books NCCL's waits as next to nothing anyway
        waited: list[float] | None = [] if self.device.type == "cpu" else None
        norm = clip_grad_norm(
            params, max_norm, pp_group=pp_group, device=self.device, waited=waited, not_counted=self._norm_skip
        )
        self.collective_s += sum(waited or ())
        return norm

    def token_batches(
        self,
        *,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        val_fraction: float = 0.0,
        vocab_size: int | None = None,
    ) -> Any:
        """This rank's loader of the job's prepared token dataset (`data.manifest`, made by `hpcscale data
        prepare`): a hpcscale.data.loader.TokenLoader whose `next_batch()` returns this data-parallel rank's
        slice (inputs, targets) of each global batch as int64 numpy arrays, the same global batches at every
        layout, in an order fixed by `seed`; pass it to ctx.checkpoint.restore (`data=loader`) and a resumed
        run carries on where the last save was. `vocab_size`: the model's vocabulary; a dataset whose tokenizer
        has more ids is refused (BadInput, exit 2 at start) rather than indexing past the embedding."""
        from hpcscale.data.loader import TokenLoader  # lazy: data.loader imports numpy, which this module avoids

        if not self.job.data.manifest:
            raise BadInput("ctx.token_batches: the job names no data.manifest (hpcscale data prepare makes one)")
        path = expand_path(self.job.data.manifest)
        loader = TokenLoader(
            path,
            seq_len=seq_len,
            global_batch=global_batch,
            dp_rank=self.dp_rank,
            dp_size=self.dims.dp,
            seed=seed,
            val_fraction=val_fraction,
        )
        if vocab_size is not None and loader.vocab_size > vocab_size:
            raise BadInput(
                f"{path}: the dataset's vocabulary is {loader.vocab_size} tokens, the model's {vocab_size}: ids "
                f">= {vocab_size} would index past its embedding (prepare the data with the model's tokenizer, "
                "or give the model the tokenizer's vocabulary size)"
            )
        return loader

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here only accumulate gradients; the next backward outside averages the sum
        (gradient accumulation, as DDP's no_sync)."""
        with contextlib.ExitStack() as stack:
            for sync in self._syncs:
                stack.enter_context(sync.no_sync())
            yield

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """For a step's micro-batches before its last: the gradient communication that can wait for the last
        one waits, without holding more than the rank's share of the gradients. Replicated data parallelism:
        as no_sync (one all-reduce per step). HSDP (1 < dp_shard < dp): each micro-batch still reduce-scatters
        within its shard group, the all-reduce across replicas runs once per step. Plain FSDP (dp_shard = dp):
        nothing waits, each micro-batch reduce-scatters (no_sync would hold whole gradients instead)."""
        with contextlib.ExitStack() as stack:
            for sync in self._syncs:  # a GradSync defers as no_sync does; a ShardedSync says what it defers
                stack.enter_context(sync.accumulate() if hasattr(sync, "accumulate") else sync.no_sync())
            yield

    @property
    def checkpoint(self) -> Any:
        """The job's checkpoints for this code: restore(model, optimizer, **state) and step(step)
        (hpcscale.launch.checkpointing.Checkpointer, docs/context-api.md)."""
        if self._checkpoint is None:
            from hpcscale.launch.checkpointing import Checkpointer  # lazy: imports torch; the Context needs none

            self._checkpoint = Checkpointer(self)
        return self._checkpoint

    def should_stop(self) -> bool:
        """Whether any rank received a stop signal. A collective over all ranks: call it everywhere."""

        return self.any_of_and_sums([self.stop.requested], {})[0][0]

    def close(self) -> None:
        """The entry point returned: the last step's save (ctx.checkpoint's, if used) is committed and any in
        flight waited for. Called by launch, once."""
        if self._checkpoint is not None:
            self._checkpoint.close()

    def any_of_and_sums(self, flags: Any, sums: dict[str, Any]) -> tuple[list[bool], dict[str, float]]:
        """For each flag, whether any rank's is set, and each of `sums` (one-element tensors on this rank's
        device) summed over every rank, in fp64: one all-reduce and one read back to the host."""
        import torch
        import torch.distributed as dist

        flags = list(flags)
        host = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64)
        if self.device.type == "cuda":  # from page-locked memory the copy is queued, not waited for
            host = host.pin_memory()
        parts = [host.to(self.device, non_blocking=True)]
        parts += [v.detach().reshape(1).to(device=self.device, dtype=torch.float64) for v in sums.values()]
        t = torch.cat(parts)
        dist.all_reduce(t)
        values = t.tolist()  # the host waits here, once, for everything the step queued
        return [x > 0 for x in values[: len(flags)]], dict(zip(sums, values[len(flags) :], strict=True))

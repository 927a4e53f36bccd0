"""The trainer's side of cross-site rounds (docs/cross-site.md): round checkpoints and adopting θ(r).

A job with `xsite: {config, site}` trains in rounds of H = `round_steps` inner steps. At step 0 of a fresh run
it saves a *start checkpoint* (tag base_round −1: the aggregator publishes round 0 from its own), then waits
for θ(0). With `xsite.start_from` a fresh run first loads the newest checkpoint there (a pretrained model: its
weights, optimizer state and step, not its data position) and its rounds start at that step S: the start
checkpoint is saved at S, and boundaries fall at S + kH (every tag carries `start` = S). At every round
boundary it saves a *round checkpoint* tagged with the global round its weights started from (base_round), the
steps and the tokens since, which the site's `hpcscale sync` tick turns into a contribution Δ = θ(base) −
θ_site; then it waits up to `wait_seconds` for the next global round and adopts it: the model's parameters
become θ(r), the inner optimizer's state stays (DiLoCo). A wait that times out trains on from the local
weights and adopts the newest round at a later boundary (its next contribution is then for the same base
round, which the tick does not send twice: those steps count toward the base's next round).

With `adopt: overlap` the trainer does not wait at a boundary: it keeps a copy of its weights there and keeps
training; when θ(r) lands (rank 0 looks every `poll_every` steps) it adopts θ(r) plus the progress made since
the boundary, θ ← θ(r) + (θ_now − θ_boundary), so no step is lost and none counted twice (the next Δ holds the
steps since the boundary). It is at most one round late: at the next boundary a round still missing is
waited for (up to wait_seconds) before the next round checkpoint. The copy is in host memory; a restart in
the middle reads it back from the boundary's round checkpoint (rebuild_snapshot), so the round in flight is
adopted as if there had been no restart. Only when that checkpoint is gone (keep_last) or unreadable are the
steps up to the next boundary not contributed (that boundary's checkpoint has the base already exported).

Every rank decides the same thing: rank 0 looks for θ(r) and broadcasts what it found once a second, so the
wait is never one long collective (the collective timeout stays what the job says).

What a trainer adopts is only what the site's sync tick handed over (hpcscale.xsite.handed): the newest round
in the tick's record RUN/xsite/handed.json, from the file that record names, of its size and sha256, in a
RUN/xsite that only the user (or root) can write; never a file merely named global-r… there. A round whose
file is not that (replaced, a symbolic link, a FIFO, damaged), or whose tensors are not this model's or not
finite, is skipped with a line saying why, and training goes on: the next round is taken as usual. A RUN/xsite
or record that cannot be trusted (another user's directory, one others can write) ends the wait at once with
a line and the fix (it will not change by itself), and training goes on from the site's own weights; the
site's `hpcscale sync` says the same at every tick. Nothing here stops a training for what someone else did
to its run directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpcscale.ckpt.format import INDEX, read_index, step_dir_name
from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.ckpt.reader import load_shards
from hpcscale.ckpt.shards import local_shards
from hpcscale.config.xsite import XsiteConfig, load_xsite
from hpcscale.errors import BadInput, VerificationFailure
from hpcscale.util.paths import expand_path
from hpcscale.util.trust import check_private_dir
from hpcscale.xsite import handed
from hpcscale.xsite.outer import check_finite
from hpcscale.xsite.rounds import TAG

POLL_S = 1.0


class Rounds:
    def __init__(self, ctx, model: torch.nn.Module, *, tokens_per_step: int, pins=lambda: None):
        """`pins()`: the CheckpointManager whose retention the start checkpoint is pinned against (None: none)."""
        spec = ctx.job.xsite
        self.cfg: XsiteConfig = load_xsite(expand_path(spec.config))
        self.site = spec.site
        self.H = self.cfg.round_steps
        self.ctx, self.model, self.tokens_per_step, self.pins = ctx, model, tokens_per_step, pins
        self.run: Path = ctx.run_dir
        self.base = -1  # the global round the current weights started from (-1: none adopted yet)
        self.since = 0  # the step at which they were adopted
        self.start = 0  # the step the rounds started at: 0, or the step of xsite.start_from's checkpoint
        self.check_start = False  # begin_at: θ(0) must equal the weights xsite.start_from gave this site
        self.overlap = self.cfg.adopt == "overlap"
        self.poll_every = max(1, self.H // 10)
        self.snapshot: dict[str, torch.Tensor] | None = None  # overlap: the weights at the boundary (local shards)
        self.snapshot_step = 0
        self.refused: set[int] = set()  # global rounds found unfit to adopt (_take): never taken, never waited for
        self.said: str | None = None  # (rank 0) why no round can be taken now, said once until it changes

    # ---- state carried in checkpoints ------------------------------------------------------------------------
    def state_for_save(self, step: int) -> dict:
        """Called before every save: the `xsite` entry of that checkpoint's trainer state (`tag`), after pinning
        the start checkpoint against retention until θ(0) is adopted (and unpinning it after): the aggregator's
        tick publishes round 0 from it, and a trainer whose wait for θ(0) timed out trains on and saves, which
        keep_last alone would let delete it (round 0 would never come)."""
        manager = self.pins()
        if manager is not None:
            if self.base == -1:
                manager.pin(self.start, "cross-site start checkpoint: round 0 is published from it")
            else:
                manager.unpin(self.start)
        return self.tag(step)

    def tag(self, step: int) -> dict:
        """The `xsite` entry of a checkpoint's trainer state; at the start step the start checkpoint's (base −1).
        `start` only when the rounds did not start at 0 (what older checkpoints lack means 0)."""
        where = {"start": self.start} if self.start else {}
        if step == self.start and self.base == -1:
            return {"base_round": -1, "site": self.site, **where}
        steps = step - self.since
        return {
            "base_round": self.base,
            "since": self.since,
            "steps": steps,
            "tokens": steps * self.tokens_per_step,
            "site": self.site,
            **where,
        }

    def restore(self, state: dict) -> None:
        tag = state.get(TAG)
        if isinstance(tag, dict) and type(tag.get("base_round")) is int:
            self.base = tag["base_round"]
            self.since = int(tag.get("since", 0)) if type(tag.get("since")) is int else 0
            self.start = tag["start"] if type(tag.get("start")) is int and tag["start"] >= 0 else 0

    def begin_at(self, step: int) -> None:
        """The rounds start at `step` (xsite.start_from's checkpoint), not at 0; θ(0), when it comes, must be
        the weights loaded from there (checked once, in wait_and_adopt)."""
        self.start, self.since = step, step
        self.check_start = True

    def is_boundary(self, done_steps: int) -> bool:
        return done_steps >= self.start and (done_steps - self.start) % self.H == 0

    # ---- the boundary, as the trainer calls it ------------------------------------------------------------------
    def boundary(self, done_steps: int, save_and_wait) -> None:
        """At a round boundary (or the start, `self.start`): the round in flight first (overlap), then the round
        checkpoint the sync tick exports (`save_and_wait()`: saved synchronously and committed), then wait for the next
        round, or keep the boundary's weights and train on (overlap)."""
        self.before_round_checkpoint(done_steps)
        save_and_wait()
        self.after_round_checkpoint(done_steps)

    def before_round_checkpoint(self, done_steps: int) -> None:
        """overlap: the round that was in flight since the last boundary is adopted (waited for) first, so the
        round checkpoint names the newest base. wait: nothing."""
        if self.overlap and self.snapshot is not None and done_steps > self.start:
            self.wait_and_adopt(done_steps)

    def after_round_checkpoint(self, done_steps: int) -> None:
        """wait (and the start): wait for the next round and adopt it. overlap: keep the boundary's weights and
        train on."""
        if not self.overlap or (done_steps == self.start and self.base == -1):
            self.wait_and_adopt(done_steps)
        elif self.snapshot is None:  # in host memory: an extra copy of the weights must not cost device memory
            self.snapshot = {n: _local(p).detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
            self.snapshot_step = done_steps

    def poll(self, done_steps: int) -> int | None:
        """overlap, between boundaries: adopt θ(r) if it has landed (every poll_every steps). Collective."""
        if self.snapshot is None or (done_steps - self.snapshot_step) % self.poll_every:
            return None
        return self.wait_and_adopt(done_steps, wait_s=0.0)

    def rebuild_snapshot(self, done_steps: int, checkpoints: Path) -> bool:
        """overlap, restarted between two boundaries while a round is in flight (none adopted since the last
        boundary): the boundary's weights, kept in host memory, died with the process; they are the boundary's
        round checkpoint's model, so read them back. Each rank reads its own part; all or none (one all-reduce).
        False when there is nothing in flight, or that checkpoint is gone or unreadable (said in the log)."""
        if not self.overlap or self.is_boundary(done_steps) or self.snapshot is not None:
            return False
        boundary = done_steps - (done_steps - self.start) % self.H
        if self.since >= boundary:  # a round was adopted after the boundary: nothing in flight
            return False

        copies = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        problem = None
        try:
            index = read_index(checkpoints / step_dir_name(boundary) / INDEX)
            load_shards(index, checkpoints, local_shards({f"model/{canonical_name(n)}": t for n, t in copies.items()}))
        except Exception as e:  # every rank must reach the all-reduce below
            problem = f"{type(e).__name__}: {e}"
        ok = torch.tensor([0.0 if problem else 1.0], device=self.ctx.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1:
            self.ctx.metrics.print(
                f"hpcscale: the round in flight since step {boundary} will be adopted without the steps taken "
                f"since: its boundary weights cannot be read back ({problem or 'on another rank'})"
            )
            return False
        self.snapshot = {name: _local(t).to("cpu", copy=True) for name, t in copies.items()}
        self.snapshot_step = boundary
        self.ctx.metrics.print(f"hpcscale: round in flight since step {boundary}: its boundary weights read back")
        return True

    # ---- adopting θ(r) ---------------------------------------------------------------------------------------
    def wait_and_adopt(self, done_steps: int, *, wait_s: float | None = None) -> int | None:
        """Wait (up to wait_seconds, or `wait_s`) for a global round newer than base; adopt it. Collective."""
        limit = self.cfg.wait_seconds if wait_s is None else wait_s
        t0 = time.monotonic()
        entry: handed.Handed | None = None
        while True:
            decision: list = [None, False]
            if self.ctx.rank == 0:
                newest, blocked = self._newest(done_steps)
                if newest is not None and newest.round > self.base and newest.round not in self.refused:
                    decision = [newest.to_json(), True]
                elif blocked or time.monotonic() - t0 >= limit or self.ctx.stop.requested:
                    decision = [None, True]  # blocked: RUN/xsite is refused, which waiting does not change
            dist.broadcast_object_list(decision, src=0)
            if decision[1]:
                entry = None if decision[0] is None else handed.Handed(**decision[0])
                break
            time.sleep(POLL_S)
        waited = round(time.monotonic() - t0, 3)
        if entry is None:
            if limit > 0:  # a wait that timed out is news; a poll that found nothing is not
                self.ctx.metrics.log(step=done_steps - 1, xsite_wait_s=waited, xsite_round=None)
            return None
        found = entry.round
        snapshot = self.snapshot
        theta, problem = self._take(entry)
        if problem is not None:
            self.refused.add(found)
            self.ctx.metrics.log(step=done_steps - 1, xsite_refused_round=found, reason=problem)
            self.ctx.metrics.print(
                f"hpcscale: not adopting global round {found}: {problem}; training on from this site's weights "
                "until a later round arrives"
            )
            return None
        if self.check_start:
            self.check_start = False
            if found == 0:
                self._same_start(theta)
        self._load(theta, snapshot)
        self.base, self.since = found, (self.snapshot_step if snapshot is not None else done_steps)
        self.snapshot = None
        extra = {} if snapshot is None else {"xsite_kept_steps": done_steps - self.snapshot_step}
        kept = f", kept {done_steps - self.snapshot_step} local steps" if snapshot is not None else ""
        self.ctx.metrics.log(step=done_steps - 1, xsite_wait_s=waited, xsite_round=found, **extra)
        self.ctx.metrics.print(
            f"hpcscale: adopted global round {found} at step {done_steps} (waited {waited:.1f} s{kept})"
        )
        return found

    def _newest(self, done_steps: int) -> tuple[handed.Handed | None, bool]:
        """(rank 0) (the newest round the sync tick handed over, by its record; whether RUN/xsite or the record
        is refused). A refusal is said once (until it changes), with the fix the message carries."""
        try:
            newest = handed.latest(self.run)
        except handed.RecordError as e:
            if self.said != str(e):
                self.said = str(e)
                self.ctx.metrics.log(step=done_steps - 1, xsite_refused_round=None, reason=str(e))
                self.ctx.metrics.print(
                    f"hpcscale: no global round can be taken: {e}; training on from this site's weights (the site's "
                    "`hpcscale sync` says the same at every tick)"
                )
            return None, True
        self.said = None
        return newest, False

    def _take(self, entry: handed.Handed) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """(θ of the handed round `entry`, None) or (None, why not): the file its record names, of its size and
        sha256 (handed.load), of this model's names and shapes, finite. Collective: a refusal on one rank is
        every rank's, so that no rank adopts a round its peers do not."""
        theta, problem = None, None
        try:
            theta = handed.load(self.run, entry)
        except (handed.Refused, handed.RecordError) as e:
            problem = str(e)
        if problem is None:
            problem = self._unfit(theta)
        ok = torch.tensor([0.0 if problem else 1.0], device=self.ctx.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1:
            return None, problem or "refused on another rank (its line says why)"
        return theta, None

    def _unfit(self, theta: dict[str, torch.Tensor]) -> str | None:
        """Why θ(r) must not become this model's weights (None: it may): a tensor missing, extra or of another
        shape than the parameter it replaces, or a value that is not finite. The sync tick refuses such rounds
        already; a file planted in the run directory must not reach the weights either."""

        # every parameter this rank holds must be there with its global shape; θ may hold more (buffers, which
        # stay the site's own, and a pipeline's other stages)
        params = {canonical_name(n): tuple(p.shape) for n, p in self.model.named_parameters()}
        got = {k: tuple(v.shape) for k, v in theta.items()}
        missing = sorted(params.keys() - got.keys())
        if missing:
            return f"its tensors are not this model's (no {missing[:3]}{' ...' if len(missing) > 3 else ''})"
        wrong = [k for k in params if params[k] != got[k]]
        if wrong:
            return f"{wrong[0]} has shape {got[wrong[0]]}, the model's is {params[wrong[0]]}"
        return check_finite({k: theta[k] for k in params})

    def _same_start(self, theta: dict[str, torch.Tensor]) -> None:
        """xsite.start_from: θ(0) is the aggregator's start checkpoint, so it must be, bit for bit, what this site
        loaded. If not, the sites did not start from one checkpoint (the aggregator's job has no start_from,
        names another one, or its run had checkpoints of its own): refused on every rank, before adopting it
        would silently drop the pretrained weights. Collective."""
        try:
            with torch.no_grad():
                # every parameter compared on every rank, never stopping at the first difference: a rank that
                # stopped early while its peers go on would leave them in a collective (none is made here since
                # _shard slices locally, but the comparison must not depend on that)
                checks = [
                    torch.equal(self._shard(name, p, theta), _local(p)) for name, p in self.model.named_parameters()
                ]
            same = all(checks)
        except RuntimeError:  # a tensor missing or shaped otherwise: not that checkpoint either; every rank must
            same = False  # reach the all-reduce below
        ok = torch.tensor([1.0 if same else 0.0], device=self.ctx.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1:
            raise BadInput(
                f"xsite.start_from: global round 0 is not the checkpoint this site started from "
                f"({self.ctx.job.xsite.start_from}):"
                " the aggregator's site started from other weights (its job has no xsite.start_from, names another "
                "checkpoint, or its run had checkpoints of its own). Give every site the same start_from and start "
                "the cross-site training again with empty state directories (docs/cross-site.md)"
            )

    def _shard(self, name: str, p: torch.Tensor, theta: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's part of θ's tensor for parameter `name`, in p's dtype, on p's device."""
        key = canonical_name(name)
        if key not in theta:
            raise RuntimeError(f"global round has no tensor {key}: not this model's weights")
        full = theta[key].to(dtype=p.dtype)
        if hasattr(p, "to_local"):  # a DTensor: this rank's shard of the full tensor
            from torch.distributed.tensor import distribute_tensor

            # src_data_rank=None: every rank holds the whole θ, so each takes its slice locally; no collective
            # (the default would broadcast from the mesh's first rank, a tp-group collective per parameter)
            return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
        if tuple(full.shape) != tuple(p.shape):
            raise RuntimeError(f"global round's {name} has shape {tuple(full.shape)}, not {tuple(p.shape)}")
        return full.to(p.device)

    def _load(self, theta: dict[str, torch.Tensor], snapshot: dict[str, torch.Tensor] | None = None) -> None:
        """The parameters become θ(r); with a boundary snapshot, θ(r) + (current − snapshot)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                new = self._shard(name, p, theta)
                local = _local(p)
                if snapshot is not None:  # the steps taken since the boundary, kept
                    new = new + (local - snapshot[name].to(local.device))
                local.copy_(new)


def _start_from_problem(root: Path) -> str | None:
    """Why xsite.start_from cannot be loaded from, or None: not a directory, or one that someone other than the
    user or root could have written (util/trust.check_private_dir: the directory, its steps and their data/).
    Its checkpoints' digests and indexes are in it too, so whoever can write there chooses the weights every
    site starts from."""
    if not root.is_dir():
        return f"xsite.start_from: {root} is not a directory (give a run's checkpoints/ directory)"
    try:
        check_private_dir(root, what="xsite.start_from checkpoint directory", reading=True)
    except BadInput as e:
        return f"xsite.start_from: {e}"
    return None


def load_start_from(ctx, dims, tensors: dict[str, torch.Tensor], *, check_state=None, steps: int | None = None):
    """xsite.start_from: load the newest checkpoint there that every rank can read and verify into `tensors`
    (the caller's model and optimizer state; another layout is resharded), never writing under it. Returns it
    (hpcscale.ckpt.manager.Restored: the step and the trainer state); the caller takes neither the data position
    nor the RNG from it. Refused (VerificationFailure) when none loads: a site must not start from anything else;
    BadInput when it is at or past `steps` (the training's last step), where no round could follow. Collective."""

    root = expand_path(ctx.job.xsite.start_from)
    seen = [_start_from_problem(root) if ctx.rank == 0 else None]  # rank 0's answer for every rank: one rank
    dist.broadcast_object_list(seen, src=0)  # raising alone would hang the others
    if seen[0] is not None:
        raise BadInput(seen[0])
    manager = CheckpointManager(
        root,
        dims=dims,
        rank=ctx.rank,
        log=ctx.metrics.print,
        read_only=True,
        device=ctx.device,
        timeout_s=ctx.job.timeout_seconds,
    )
    try:
        got = manager.load_latest(tensors, check_state=check_state, check_rng=False)
    finally:
        manager.close()
    if got is None:
        raise VerificationFailure(
            f"xsite.start_from: no checkpoint in {root} loads (the lines above say why, if it has any): this site "
            "cannot start from it, and starting from anything else would not be the same start as the other sites'"
        )
    if steps is not None and got.step >= steps:
        raise BadInput(
            f"xsite.start_from: {root / step_dir_name(got.step)} is at step {got.step}, and this training ends at "
            f"step {steps} (train.params.steps): no round would follow. Raise steps to the whole training's"
        )
    ctx.metrics.print(
        f"hpcscale: started from {root / step_dir_name(got.step)} (xsite.start_from): the rounds start at step "
        f"{got.step}"
    )
    return got


_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name as checkpoints (torch's get_state_dict) spell it: without the segments that
    torch.compile, activation checkpointing and FSDP wrappers insert (`_orig_mod.w` is saved as `w`). A
    DDP-wrapped model's `module.` prefix is not removed here: ctx.parallelize never wraps in DDP."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p

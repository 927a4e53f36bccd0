"""The node-local checkpoint tier's manager (the mechanics of partner copies and recovery are
hpcscale.ckpt.nodelocal; what both tiers share, hpcscale.ckpt.tier)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hpcscale.ckpt import faults
from hpcscale.ckpt.format import DIGEST, INDEX, committed_steps, read_index, step_dir_name
from hpcscale.ckpt.nodelocal import (
    NodeLocal,
    complete_steps,
    holdings,
    needed_files,
    remember_digest,
    transfer,
    verify_held,
    write_node_local_record,
)
from hpcscale.ckpt.reader import load_shards
from hpcscale.ckpt.retention import apply_retention
from hpcscale.ckpt.rng import rng_problem
from hpcscale.ckpt.shards import local_shards
from hpcscale.ckpt.tier import Restored, Tier, state_problem
from hpcscale.ckpt.writer import install, prepare_index
from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.portable.files import atomic_write
from hpcscale.util.trust import private_dir

__all__ = ["NodeLocalManager"]


class NodeLocalManager(Tier):
    """The node-local tier (hpcscale.ckpt.nodelocal): `root` is a directory on each node's own storage. Every node
    writes its ranks' data and its own copy of the index, partner nodes keep copies of the data, each save stands
    alone (no chunk of an earlier step is referenced), and load_node_local gathers a step from what the surviving
    nodes hold. The node's lowest rank does there what rank 0 does in a shared root."""

    WHAT = "node-local checkpoint directory"

    def __init__(self, root: Path, *, node_local: NodeLocal, **kwargs):
        self.node_local = node_local
        # where rank 0 records which nodes hold the newest step (read by `hpcscale resume`)
        self.record: Path | None = None
        self.committed: set[int] = set()  # the steps this process's saves committed on every node
        self.moved = (0, 0)  # data files, bytes sent between nodes by the last load_node_local that succeeded
        super().__init__(root, **kwargs)

    def _keeper_rank(self) -> int:
        nl = self.node_local
        return nl.leader(nl.node_of[self.rank])

    def _take_root(self, owner: str | None) -> str | None:
        """The node's keeper: its directory made 0700 (a node's own disk: no one else needs it), or accepted only
        if it is private already (hpcscale.util.trust.private_dir); node-local directories are named by the run's
        id, so there is nothing to claim."""
        where = f"node {self.node_local.node_of[self.rank]}: "
        try:
            private_dir(self.root, what=self.WHAT, mode=0o700)
        except BadInput as e:
            return f"{where}{e}"
        except Exception as e:
            return f"{where}{self.root}: cannot make it this run's {self.WHAT}: {type(e).__name__}: {e}"
        return None

    def _fresh_save(self) -> None:
        self.writer.forget()  # every node-local step stands alone

    def _commit(self, step, parts, parent, trainer_state, result, created):
        """Every rank, after the gather: rank 0 writes the index, every node's lowest rank installs the same
        bytes in its own root and commits there, then each rank's data file is copied to its node's partners.
        The save fails (on every rank alike) unless every node committed; a partner copy that fails is said,
        not fatal: the step is then only as safe as the nodes that hold it."""
        nl = self.node_local
        name = step_dir_name(step)
        payload: list = [None]
        if self.rank == 0:
            errors = [p["error"] for p in parts if p["error"]]
            if errors:
                payload = [("failed", "; ".join(errors))]
            else:
                try:
                    index = prepare_index(
                        self.root, step, parts, layout=self.dims.as_dict(), parent=parent, trainer_state=trainer_state
                    )
                    tmp = self.root / f".tmp-{name}"
                    blobs = {f: (tmp / f).read_bytes() for f in (INDEX, DIGEST)}
                    payload = [("ok", (blobs, sorted(index.files()), index.digest))]
                except Exception as e:
                    payload = [("failed", f"rank 0 index: {type(e).__name__}: {e}")]
        dist.broadcast_object_list(payload, src=0, group=self.group)
        status, detail = payload[0]
        problem = None
        if status == "ok" and self._keeper:
            try:
                tmp = self.root / f".tmp-{name}"
                if self.rank != 0:
                    tmp.mkdir(mode=0o755, exist_ok=True)  # inside the node's private root (_take_root)
                    for f, blob in detail[0].items():
                        atomic_write(tmp / f, blob)
                keep = frozenset(self.pinned)
                # a step of an abandoned timeline (saved, then the job restarted from an older one): node-local
                # steps stand alone, so nothing else refers to it
                shutil.rmtree(self.root / name, ignore_errors=True)
                # keep_last steps besides this one until its partner copies are made (below): until then a lost
                # node takes its part of this step along, and the steps before it are what recovery has
                install(self.root, step, keep_last=self.keep_last + 1, keep_every=self.keep_every, keep=keep)
            except Exception as e:
                problem = f"node {nl.node_of[self.rank]}: {type(e).__name__}: {e}"
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem, group=self.group)
        if status != "ok" or any(problems):
            self.writer.failed()
            why = detail if status != "ok" else next(p for p in problems if p)
            raise RuntimeFailure(f"node-local checkpoint of step {step} failed: {why}")
        files = set(detail[1])
        writer_of = {f: r for r in range(len(nl.node_of)) if (f := f"{name}/data/rank-{r:05d}.bin") in files}
        copies = [(r, nl.leader(p), f) for f, r in writer_of.items() for p in nl.partners[nl.node_of[r]]]
        faults.fault("partner_copy", self.rank)  # tests only: a node lost between its step and its partner copies
        mine = transfer(copies, rank=self.rank, root=self.root, group=self.group)
        failed = [None] * dist.get_world_size()
        dist.all_gather_object(failed, mine, group=self.group)
        if self.rank == 0 and any(failed):
            lost = "; ".join(p for ps in failed for p in ps)
            self.log(f"hpcscale: warning: node-local {name}: partner copies failed: {lost}")
        if self._keeper:  # the copies made: now the retention keep_last says
            try:
                apply_retention(
                    self.root, keep_last=self.keep_last, keep_every=self.keep_every, keep=frozenset(self.pinned)
                )
            except OSError as e:
                self.log(f"hpcscale: warning: node {nl.node_of[self.rank]}: node-local retention: {e}")
        if self.rank == 0 and self.record is not None:
            holders = {f: [nl.node_of[r]] for f, r in writer_of.items()}
            for src, dst, f in copies:  # a copy counts once neither side said it failed
                if not any(f in p for p in failed[src] + failed[dst]):
                    holders[f].append(nl.node_of[dst])
            try:
                write_node_local_record(self.record, step=step, nodes=nl.nodes, holders=holders)
            except OSError as e:
                self.log(f"hpcscale: warning: cannot record the node-local tier in {self.record}: {e}")
        self.writer.committed([])
        self.last_step = step
        remember_digest(self.root, step, detail[2])  # what a drain of this step must find (drain_source)
        self.committed.add(step)
        if len(self.committed) > 4096:  # bounded: a drain never waits for thousands of node-local saves
            self.committed.discard(min(self.committed))
        return result

    def discard_after(self, step: int | None) -> None:
        """Node-local tier: remove this node's steps newer than `step` (the one the run restarted from; None:
        from scratch). They belong to a timeline the run abandoned, and recovery must never prefer them."""
        if not self._keeper:
            return
        for s in committed_steps(self.root):
            if step is None or s > step:
                (self.root / step_dir_name(s) / INDEX).unlink(missing_ok=True)  # not a step any more, first
                shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)

    def load_node_local(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        at_least: int | None,
        below: int | None = None,
        check_state: Callable[[dict], str | None] | None = None,
    ) -> Restored | None:
        """Node-local tier: load the newest step, no older than `at_least` and older than `below` (the steps from
        `below` on were tried already: each is hashed and refused once), that the nodes of this job hold whole
        between them, reading nothing from any shared filesystem. Each node's lowest rank verifies what its node
        holds (every chunk hashed: a corrupt copy does not count); a node that lacks the index, or a data file
        one of its ranks needs, gets it from a node that holds it, over the checkpoint group; then every rank
        loads from its own node as load_latest does (any layout). A step some rank cannot load is refused on
        every rank and the next older one tried. None when none is left (`tensors_dirty` as in load_latest)."""
        nl = self.node_local
        self.tensors_dirty = False
        # what each node holds (indexes read and checked, data files present); the chunks are hashed only for the
        # step tried, below: an older step is read only when a newer one fails
        held = holdings(self.root, verify=False, log=self.log, below=below) if self._keeper else None
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held, group=self.group)
        per_node = {nl.node_of[r]: h for r, h in enumerate(everyone) if h is not None}
        targets = local_shards(tensors)
        dirty = False
        self.moved = (0, 0)  # data files, bytes sent between nodes by the load that succeeded
        for step in complete_steps(per_node):
            if at_least is not None and step < at_least:
                break
            name = step_dir_name(step)
            verified = verify_held(self.root, step, held.get(step)) if self._keeper else None
            dist.all_gather_object(everyone, verified, group=self.group)
            for r, v in enumerate(everyone):
                if v is None:
                    continue
                entry, refused = v  # a keeper's word on its node: what verifies, or nothing
                if entry is None:
                    per_node[nl.node_of[r]].pop(step, None)
                else:
                    per_node[nl.node_of[r]][step] = entry
                for why in refused if self.rank == 0 else ():
                    self.log(f"hpcscale: {nl.node_of[r]}: {why}")
            if step not in complete_steps({nd: {step: h[step]} for nd, h in per_node.items() if step in h}):
                if self.rank == 0:
                    self.log(f"hpcscale: node-local {name}: the copies that verify do not make it whole")
                continue
            have = {nd: set(h[step][1]) if step in h else None for nd, h in per_node.items()}
            source = {}  # file -> the first node (in node order) that holds a verified copy
            for nd in nl.nodes:
                for f in have.get(nd) or ():
                    source.setdefault(f, nd)
            with_index = next(nd for nd in nl.nodes if have.get(nd) is not None)
            moves = [
                (nl.leader(with_index), nl.leader(nd), f"{name}/{f}")
                for nd in nl.nodes
                if have.get(nd) is None
                for f in (DIGEST, INDEX)  # the index last: a directory with it is a committed step
            ]
            problem, wrote, needed = None, False, set()
            problems = transfer(moves, rank=self.rank, root=self.root, group=self.group)
            dist.barrier(group=self.group)  # the node's index in place before its other ranks read it
            try:
                if not problems:
                    index = read_index(self.root / name / INDEX)
                    needed = needed_files(index, targets)
            except Exception as e:
                problems.append(f"{self.root / name}: {type(e).__name__}: {e}")
            wants: list = [None] * dist.get_world_size()
            dist.all_gather_object(wants, (problems, sorted(needed)), group=self.group)
            bad = [p for ps, _ in wants for p in ps]
            if not bad:
                missing = sorted(
                    {(nl.node_of[r], f) for r, (_, fs) in enumerate(wants) for f in fs}
                    - {(nd, f) for nd, fs in have.items() for f in fs or ()}
                )
                moves = [(nl.leader(source[f]), nl.leader(nd), f) for nd, f in missing]
                received: list[int] = []
                moved = transfer(moves, rank=self.rank, root=self.root, group=self.group, received=received)
                problem = "; ".join(moved) or None
                same_layout = False
                dist.barrier(group=self.group)  # every file in place on every node before any rank reads
                try:
                    if problem is None:
                        same_layout = index.layout == self.dims.as_dict()
                        problem = state_problem(index.trainer_state, check_state) or (
                            rng_problem(index.rng.get(self.rank), self.device) if same_layout else None
                        )
                    if problem is None:
                        wrote = True
                        load_shards(index, self.root, targets)
                except VerificationFailure as e:
                    problem = str(e)
                except Exception as e:
                    problem = f"{self.root / name}: unexpected {type(e).__name__}: {e}"
                outcome: list = [None] * dist.get_world_size()
                dist.all_gather_object(outcome, (problem, wrote, sum(received)), group=self.group)
                bad = [p for p, _, _ in outcome if p]
                dirty = dirty or any(w for _, w, _ in outcome)
                self.moved = (len(moves), sum(n for _, _, n in outcome))
            if bad:
                if self.rank == 0:
                    self.log(f"hpcscale: refusing node-local {name}: {bad[0]}; trying an older one")
                continue
            self.last_step = step
            remember_digest(self.root, step, index.digest)  # loaded and verified: a drain may take it
            return Restored(step, index.trainer_state, index.rng.get(self.rank) if same_layout else None)
        self.tensors_dirty = dirty
        return None

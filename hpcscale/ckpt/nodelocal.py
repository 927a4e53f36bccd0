"""The node-local checkpoint tier: saves to each node's own storage, partner copies on other nodes, and recovery
that gathers a complete step from what the surviving nodes hold (docs/checkpoint-format.md#node-local-tier).

A node-local step is an ordinary checkpoint spread over nodes. Every node that took part holds its index
(`step-N/index.h5` and `DIGEST`, the same bytes on every node) and the data files of its own ranks; each
node's partners (other nodes, `checkpoint.local.partners` of them) hold copies of those data files too, at the
same paths. A node-local save is self-contained: it references no earlier step's files (each rank writes all of
its chunks), so a step is complete as soon as, for every data file its index names, some node holds a copy
whose chunks hash to what the index says, and retention on one node never touches what another step needs.

Moving files between nodes goes over the checkpoint's own gloo group (send/recv of the file's bytes): there
is no shared filesystem on that path at all. Every transfer of a plan is listed in the same order on every
rank, and each rank takes part in its own in that order, so the pairs meet without a deadlock.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpcscale.ckpt.format import (
    INDEX,
    ChunkRef,
    Index,
    committed_steps,
    open_data_file,
    read_index,
    step_dir_name,
    tensor_view,
)
from hpcscale.ckpt.ops import chunk_verdict
from hpcscale.ckpt.reader import ChunkReader, overlapping, torch_dtype
from hpcscale.ckpt.shards import LocalShard
from hpcscale.ckpt.writer import PendingShard, aligned_empty
from hpcscale.errors import BadInput, VerificationFailure
from hpcscale.portable.files import atomic_write, fsync_dir
from hpcscale.util.bounded import loads_json
from hpcscale.util.trust import UntrustedFile, read_trusted

PIECE = 16 << 20  # bytes per send/recv of a file's transfer


@dataclass(frozen=True)
class NodeLocal:
    """Where each rank runs and which nodes hold copies of which: the same on every rank."""

    node_of: tuple[str, ...]  # node of each rank
    partners: dict[str, tuple[str, ...]]  # node -> the nodes that hold copies of its files
    other_switch: dict[str, tuple[bool, ...]]  # node -> for each partner, whether it is under another leaf switch

    def leader(self, node: str) -> int:
        """The lowest rank on `node`: it writes the node's index and receives what is sent to the node."""
        return self.node_of.index(node)

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.node_of))

    def describe(self) -> str:
        parts = []
        for node, held in self.partners.items():
            sides = zip(held, self.other_switch[node], strict=True)
            where = [f"{p} ({'another' if o else 'the same'} leaf switch)" for p, o in sides]
            parts.append(f"{node} -> {', '.join(where) if where else 'none'}")
        return "; ".join(parts)


def plan_partners(
    order: list[str], k: int, leaf_of: dict[str, str], *, rule: str = "other"
) -> dict[str, tuple[str, ...]]:
    """node -> the k nodes that hold its copies. A ring over the nodes in switch-tree order, shifted: every node
    holds exactly k others' copies, so partner traffic and space are even. `other` picks the shifts
    that put the most partners under another leaf switch (a switch or its power failing takes no node together
    with its copies), the longest first; `same` the most under the same one (partner copies cross no
    uplink: faster, but a leaf switch's failure can take a node and its partner together), the shortest first."""
    if rule not in ("other", "same"):
        raise ValueError(f"partner rule {rule!r}: 'other' or 'same'")
    n = len(order)
    k = min(k, n - 1)
    if k <= 0:
        return {node: () for node in order}

    def crossing(shift: int) -> int:
        return sum(leaf_of.get(order[i], "") != leaf_of.get(order[(i + shift) % n], "") for i in range(n))

    shifts = list(range(1, n))
    if rule == "other":
        shifts.sort(key=lambda s: (-crossing(s), -min(s, n - s), s))
    else:
        shifts.sort(key=lambda s: (crossing(s), min(s, n - s), s))
    chosen = shifts[:k]
    return {order[i]: tuple(order[(i + s) % n] for s in chosen) for i in range(n)}


def build(node_of: list[str], k: int, leaf_of: dict[str, str], leaf_order: list[str], rule: str) -> NodeLocal:
    rank_order = list(dict.fromkeys(node_of))
    position = {leaf: i for i, leaf in enumerate(leaf_order)}
    order = sorted(rank_order, key=lambda nd: (position.get(leaf_of.get(nd, ""), len(position)), rank_order.index(nd)))
    partners = plan_partners(order, k, leaf_of, rule=rule)
    other = {
        node: tuple(leaf_of.get(node, "") != leaf_of.get(p, "") or not leaf_of for p in held)
        for node, held in partners.items()
    }
    return NodeLocal(tuple(node_of), partners, other)


# ---- what a node holds ------------------------------------------------------------------------------------------
def file_problem(root: Path, index: Index, rel: str) -> str | None:
    """None when `root/rel` holds every chunk `index` places in it with the right hash; else what is wrong."""

    t = index.tables
    names = [s.decode() for s in t.strings["files"]]
    if rel not in names:
        return f"{rel}: not a file of {step_dir_name(index.step)}"
    rows = np.sort(t.chunks[t.chunks["file"] == names.index(rel)], order="offset")
    try:
        fd = open_data_file(root / rel)
    except OSError as e:
        return f"{root / rel}: {e.strerror or e}"
    try:
        for row in rows:
            ref = ChunkRef(row["hash"].decode(), rel, int(row["offset"]), int(row["length"]))
            if (verdict := chunk_verdict(fd, ref)) is not None:
                return f"{root / rel}: the chunk at offset {ref.offset} {verdict}"
    finally:
        os.close(fd)
    return None


def holdings(
    root: Path, *, verify: bool, log=None, below: int | None = None
) -> dict[int, tuple[str, list[str], list[str]]]:
    """step -> (root digest, the data files held here whose chunks all hash right, every data file its index
    names) for every committed step under this node's `root` (older than `below`, when given); a step whose
    index fails is left out (and said so)."""
    out: dict[int, tuple[str, list[str], list[str]]] = {}
    for step in committed_steps(root):
        if below is not None and step >= below:
            continue
        try:
            index = read_index(root / step_dir_name(step) / INDEX)
        except Exception as e:
            if log:
                log(f"hpcscale: node-local {step_dir_name(step)} on this node is refused: {e}")
            continue
        held = []
        for rel in sorted(index.files()):
            if not (root / rel).is_file():
                continue
            problem = file_problem(root, index, rel) if verify else None
            if problem is None:
                held.append(rel)
            elif log:
                log(f"hpcscale: node-local copy refused: {problem}")
        out[step] = (index.digest, held, sorted(index.files()))
    return out


def verify_held(root: Path, step: int, held: tuple | None) -> tuple[tuple | None, list[str]]:
    """(`held`, holdings' entry for `step` on this node, with only the data files whose chunks all hash right;
    None when the index no longer reads) and what was refused, for rank 0 to say."""
    if held is None:
        return None, []
    _, files, named = held
    try:
        index = read_index(root / step_dir_name(step) / INDEX)
    except Exception as e:
        return None, [f"node-local {step_dir_name(step)} under {root} is refused: {e}"]
    good, refused = [], []
    for rel in files:
        problem = file_problem(root, index, rel)
        if problem is None:
            good.append(rel)
        else:
            refused.append(f"node-local copy refused: {problem}")
    return (index.digest, good, named), refused


def complete_steps(per_node: dict[str, dict[int, tuple[str, list[str], list[str]]]]) -> list[int]:
    """Every step that the nodes together hold whole, newest first: the nodes that hold its index agree on the
    digest, and every file that index names is held (and verified) by at least one node."""
    steps = sorted({s for held in per_node.values() for s in held}, reverse=True)
    out = []
    for step in steps:
        copies = [held[step] for held in per_node.values() if step in held]
        if len({digest for digest, _, _ in copies}) != 1:
            continue
        have = {f for _, files, _ in copies for f in files}
        if set(copies[0][2]) <= have:
            out.append(step)
    return out


def needed_files(index: Index, targets) -> set[str]:
    """The data files holding a chunk of a saved shard that overlaps one of `targets` (this rank's pieces)."""

    out: set[str] = set()
    for t in targets:
        view = tensor_view(index, t.name)
        if view is None:
            continue  # the load says so
        for shard in overlapping(view, t):
            out.update(c.file for c in shard.chunks)
    return out


# ---- what this process saved, for a drain to check against --------------------------------------------------
# The node-local root's place (node_local) may be one others can rename entries in: a step read back by path
# could be one they put there, consistent in itself. A drain therefore takes a step only when its root digest is
# the one this process committed (or loaded, verified) for that step under that root, kept here in memory.
_OWN_DIGESTS: dict[tuple[str, int], str] = {}
MAX_OWN_DIGESTS = 4096


def remember_digest(root: Path, step: int, digest: str) -> None:
    """Step `step` under `root` was committed (or loaded and verified) by this process with root digest `digest`."""
    _OWN_DIGESTS.pop((str(root), step), None)
    _OWN_DIGESTS[(str(root), step)] = digest
    while len(_OWN_DIGESTS) > MAX_OWN_DIGESTS:  # bounded: the oldest go first
        _OWN_DIGESTS.pop(next(iter(_OWN_DIGESTS)))


def own_digest(root: Path, step: int) -> str | None:
    return _OWN_DIGESTS.get((str(root), step))


# ---- moving files between nodes -------------------------------------------------------------------------------
def drain_source(root: Path, step: int, rank: int, *, staging=None) -> tuple[list, dict, dict, float]:
    """What rank `rank` wrote for node-local step `step` under `root` (its node's directory), read back for a
    drain to the shared tier: its shards as PendingShards over host tensors (every chunk verified against its
    hash), its RNG states, the step's trainer state and when it was saved: everything the root digest covers,
    so the drained step's digest is the node-local one's. Only a step whose root digest is the one this process
    committed or loaded there (`remember_digest`) is read: VerificationFailure otherwise. A step stands alone,
    so every chunk of a shard this rank wrote is in this rank's own data file. `staging(shards)` (the shared
    writer's ShardWriter.staging, given shards over meta tensors) gives the buffers to read into, kept from
    drain to drain in one arena and never page-locked; without it, new page-aligned buffers."""

    name = step_dir_name(step)
    index = read_index(root / name / INDEX)
    expected = own_digest(root, step)
    if expected is None or index.digest != expected:
        why = (
            "no step of that number was saved or loaded by this job"
            if expected is None
            else (f"its root digest {index.digest} is not {expected}, the one this job saved")
        )
        raise VerificationFailure(
            f"{root / name}: refusing to drain it to the shared tier: {why}; someone may have replaced the "
            "node-local directory while the job ran"
        )
    if index.step != step or rank not in index.rng:
        raise VerificationFailure(f"{root / name}: the index is of step {index.step}, without rank {rank}")
    own = f"{name}/data/rank-{rank:05d}.bin"
    wanted = []  # (this rank's shard over a meta tensor, its chunks)
    for tensor, rec in index.tensors.items():
        for shard in rec.shards:
            if not shard.chunks or shard.chunks[0].file != own:
                continue
            if any(c.file != own for c in shard.chunks):
                raise VerificationFailure(f"{root / name}: tensor {tensor} has chunks outside {own}")
            meta = torch.empty(torch.Size(shard.shape), dtype=torch_dtype(rec.dtype), device="meta")
            wanted.append((LocalShard(tensor, meta, tuple(rec.global_shape), tuple(shard.offset)), shard.chunks))
    metas = [m for m, _ in wanted]
    buffers = staging(metas) if staging else [aligned_empty(m.tensor.shape, m.tensor.dtype) for m in metas]
    reader = ChunkReader(root)
    out = []
    try:
        for (meta, chunks), t in zip(wanted, buffers, strict=True):
            view, pos = memoryview(t.view(-1).view(torch.uint8).numpy()), 0
            for c in chunks:
                reader.read(meta.name, c, view[pos : pos + c.length])
                pos += c.length
            if pos != len(view):
                raise VerificationFailure(f"{root / name}: tensor {meta.name}: its chunks are not its shard's size")
            out.append(PendingShard(LocalShard(meta.name, t, meta.global_shape, meta.offset), t))
    finally:
        reader.close()
    return out, index.rng[rank], dict(index.trainer_state), index.created


WINDOW = 16  # files one rank sends or receives at once: at most this many pieces in memory, fds open


def batches(transfers: list[tuple[int, int, str]], window: int | None = None) -> list[range]:
    """`transfers` cut, in order, into runs in which no rank has more than `window` (WINDOW) files to send or
    receive. Every rank cuts the same list the same way, so the runs are taken in lockstep and none deadlocks."""
    window = window or WINDOW
    out, start, count = [], 0, {}
    for i, (src, dst, _) in enumerate(transfers):
        if count.get(src, 0) >= window or count.get(dst, 0) >= window:
            out.append(range(start, i))
            start, count = i, {}
        count[src] = count.get(src, 0) + 1
        count[dst] = count.get(dst, 0) + 1
    if start < len(transfers):
        out.append(range(start, len(transfers)))
    return out


def transfer(
    transfers: list[tuple[int, int, str]], *, rank: int, root: Path, group, received: list | None = None
) -> list[str]:
    """Run `transfers` ((source rank, destination rank, path under root), the same list on every rank): each
    source sends its node's copy of the file, each destination writes it under its node's root (a temporary
    name, fsynced, then renamed). Returns the problems this rank met; a transfer that fails on one side is
    still completed on the other (a source that cannot read sends a length of -1; a destination that cannot
    write receives and drops), so no rank is left waiting. `received`, when given, gets the size of each file
    this rank received.

    The transfers of a run (`batches`: up to WINDOW files per rank) go at once: the sizes first, then the files
    piece by piece (PIECE bytes of every file in flight together, each tagged with its place in the list), so a
    ring of partners moves every node's copy in the time of one, and a rank holds at most WINDOW pieces in
    memory however many files a recovery sends it."""
    problems: list[str] = []
    for run in batches(transfers):
        problems += _transfer_run(transfers, run, rank=rank, root=root, group=group, received=received)
    return problems


def _transfer_run(transfers, run: range, *, rank: int, root: Path, group, received: list | None) -> list[str]:
    mine = [(i, *transfers[i][:2], root / transfers[i][2]) for i in run if rank in transfers[i][:2]]
    if not mine:
        return []
    problems: list[str] = []
    ends: dict[int, _End] = {}
    for i, src, dst, path in mine:
        end = _End(path, peer=dst if rank == src else src, sending=rank == src, root=root)
        problem = end.open_send() if end.sending else None
        if problem:
            problems.append(problem)
        ends[i] = end
    heads = {i: torch.tensor([e.size], dtype=torch.int64) for i, e in ends.items()}
    _wait_all((dist.isend if e.sending else dist.irecv)(heads[i], e.peer, group=group, tag=i) for i, e in ends.items())
    for i, e in ends.items():
        if not e.sending:
            e.size = int(heads[i][0])
            if e.size < 0:
                problems.append(f"{e.path}: the node sending it could not read it")
                continue
            if received is not None:
                received.append(e.size)
            problem = e.open_receive()
            if problem:
                problems.append(problem)
    live = {i: e for i, e in ends.items() if e.size >= 0}
    for start in range(0, max((e.size for e in live.values()), default=0), PIECE):
        now = {i: e for i, e in live.items() if e.size > start}
        works = []
        for i, e in now.items():
            n = min(PIECE, e.size - start)
            if e.buf is None or e.buf.numel() < n:
                e.buf = torch.empty(min(PIECE, e.size), dtype=torch.uint8)
            piece = e.buf[:n]
            if e.sending:
                e.read(piece, start)
                works.append(dist.isend(piece, e.peer, group=group, tag=i))
            else:
                works.append(dist.irecv(piece, e.peer, group=group, tag=i))
        _wait_all(works)
        for e in now.values():
            if not e.sending:
                e.write(e.buf[: min(PIECE, e.size - start)], start)
    for e in ends.values():
        problem = e.finish()
        if problem:
            problems.append(problem)
    return problems


def _wait_all(works) -> None:
    for w in list(works):
        w.wait()


class _End:
    """One side of one file's transfer on this rank."""

    def __init__(self, path: Path, *, peer: int, sending: bool, root: Path):
        self.path, self.peer, self.sending, self.root = path, peer, sending, root
        self.size = -1
        self.fd: int | None = None
        self.buf: torch.Tensor | None = None
        self.problem: str | None = None
        self.reported: str | None = None  # the problem open_send/open_receive returned
        self.part = path.with_name(path.name + ".partial")

    def open_send(self) -> str | None:
        try:
            self.fd = open_data_file(self.path)
            self.size = os.fstat(self.fd).st_size
        except OSError as e:
            self.problem = self.reported = f"{self.path}: {e.strerror or e}"
        return self.problem

    def read(self, piece: torch.Tensor, start: int) -> None:
        view = memoryview(piece.numpy())
        got = 0
        if self.problem is None:
            try:
                got = os.preadv(self.fd, [view], start)
            except OSError as e:
                self.problem = f"{self.path}: {e.strerror or e}"
        if got < len(view):  # shorter than its size said (truncated meanwhile): the receiver's hashes will tell
            view[got:] = bytes(len(view) - got)

    def open_receive(self) -> str | None:
        try:
            _make_dirs(self.root, self.path.parent)
            self.fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            self.problem = self.reported = f"{self.path}: {e.strerror or e}"
        return self.problem

    def write(self, piece: torch.Tensor, start: int) -> None:
        if self.fd is None or self.problem is not None:
            return  # received and dropped: the sender is never left waiting
        try:
            view = memoryview(piece.numpy())
            done = 0
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], start + done)
        except OSError as e:  # a full disk
            self.problem = f"{self.path}: {e.strerror or e}"

    def finish(self) -> str | None:
        """Close; a received file is fsynced and renamed into place, or removed when it failed. Returns a
        problem not yet reported."""
        if self.fd is None:
            return None
        try:
            if not self.sending and self.problem is None:
                os.fsync(self.fd)
        except OSError as e:
            self.problem = f"{self.path}: {e.strerror or e}"
        finally:
            os.close(self.fd)
            self.fd = None
        if self.sending:
            return self.problem if self.problem != self.reported else None
        if self.problem is None:
            try:
                os.replace(self.part, self.path)
                fsync_dir(self.path.parent)
            except OSError as e:  # said, never raised: the other ranks are waiting for this one's word
                self.problem = f"{self.path}: {e.strerror or e}"
        else:
            with contextlib.suppress(OSError):
                self.part.unlink()
        return self.problem if self.problem != self.reported else None


def _make_dirs(root: Path, directory: Path) -> None:
    """`directory` and those between it and the node's `root` (the manager made root private: hpcscale.util.trust
    .private_dir), each mode 0755 whatever the umask: a step received from a partner is as closed to others as
    one saved here. Several ranks may make them at once."""
    here = root
    for name in directory.relative_to(root).parts:
        here = here / name
        here.mkdir(mode=0o755, exist_ok=True)


# ---- the record `hpcscale resume` reads ---------------------------------------------------------------------
RECORD = "node-local.json"  # in the run directory: which nodes hold the newest node-local step
RECORD_MAX_BYTES = 4 << 20


def write_node_local_record(path: Path, *, step: int, nodes: list[str], holders: dict[str, list[str]]) -> None:
    """Rank 0, after each node-local save: the step, the nodes that took part (each holds the index), and for
    each data file the nodes that hold a copy. Mode 0644 whatever the umask: `resume` trusts only a record
    no one else can write (plan_from_record)."""
    import json

    text = json.dumps({"step": step, "nodes": nodes, "holders": holders}, sort_keys=True) + "\n"
    atomic_write(path, text, mode=0o644, exact_mode=True)


def _fewest_holders(held_by: dict[str, set[str]], position: dict[str, int]) -> list[str]:
    """The fewest nodes that hold every file between them, greedily (Chvátal's set cover: the node holding the
    most files not yet held, the first in `position` on a tie), with counts kept per node and a heap of them
    refreshed lazily: each (file, holder) pair is counted down once, O(pairs · log nodes)."""
    import heapq

    files_of: dict[str, list[str]] = {}
    for f, by in held_by.items():
        for n in by:
            files_of.setdefault(n, []).append(f)
    count = {n: len(fs) for n, fs in files_of.items()}
    heap = [(-c, position[n], n) for n, c in count.items()]
    heapq.heapify(heap)
    covered: set[str] = set()
    chosen: list[str] = []
    while heap and len(covered) < len(held_by):
        c, at, n = heapq.heappop(heap)
        if -c != count[n]:  # counted down since it was pushed: back with its count now (one entry per node)
            heapq.heappush(heap, (-count[n], at, n))
            continue
        chosen.append(n)
        for f in files_of[n]:
            if f not in covered:
                covered.add(f)
                for m in held_by[f]:
                    count[m] -= 1
    return chosen


@dataclass(frozen=True)
class LocalChoice:
    step: int | None  # the node-local step a job on `nodes` can load; None when there is none
    nodes: list[str]  # surviving nodes that together hold it (the resubmission must include them)
    why: str


def plan_from_record(path: Path, *, lost: set[str], max_nodes: int) -> LocalChoice:
    """What the node-local tier can give a resubmission that avoids the nodes in `lost`: the newest node-local
    step (as recorded by the job) if the other nodes that hold it cover every one of its data files, and are no
    more than the job's nodes. The record is the job's own file in the run directory, and it chooses the nodes
    the resubmission runs on (`--nodelist`), so it is trusted as job.yaml is (hpcscale.util.trust.read_trusted:
    owned by the user or root, writable by no one else, not a symbolic link, checked on the descriptor read,
    at most RECORD_MAX_BYTES): UntrustedFile (BadInput, exit 2) otherwise. Within that, every field is checked;
    whatever is wrong with its contents means "no node-local step", said in `why`."""

    if not os.path.lexists(path):
        return LocalChoice(None, [], "no node-local step recorded")
    try:
        data = loads_json(
            read_trusted(path, what="node-local record", max_bytes=RECORD_MAX_BYTES),
            source=str(path),
            max_bytes=RECORD_MAX_BYTES,
        )
    except UntrustedFile:
        raise
    except (OSError, ValueError, BadInput) as e:
        return LocalChoice(None, [], f"{path}: unreadable: {e}")
    ok = (
        isinstance(data, dict)
        and type(data.get("step")) is int
        and data["step"] >= 0
        and isinstance(data.get("nodes"), list)
        and all(isinstance(n, str) for n in data["nodes"])
        and isinstance(data.get("holders"), dict)
        and all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in data["holders"].values())
    )
    if not ok:
        return LocalChoice(None, [], f"{path}: not a node-local record")
    step, holders = data["step"], data["holders"]
    survivors = list(dict.fromkeys(n for n in data["nodes"] if n not in lost))
    position = {n: i for i, n in enumerate(survivors)}
    # each file's surviving holders, once: a 4 MiB record lists ~10^5 files and nodes, so everything below is
    # linear in the record (a set cover that rescanned every file for every node hung `resume` there)
    held_by = {f: {n for n in held if n in position} for f, held in holders.items()}
    uncovered = sorted(f for f, by in held_by.items() if not by)
    if not survivors or uncovered:
        gone = ", ".join(sorted(lost & set(data["nodes"]))) or "none"
        return LocalChoice(
            None, [], f"node-local step {step}: {len(uncovered)} data file(s) held only by lost nodes ({gone})"
        )
    chosen = _fewest_holders(held_by, position)
    chosen = chosen or survivors[:1]
    if len(chosen) > max_nodes:
        return LocalChoice(None, [], f"node-local step {step}: needs {len(chosen)} nodes, the job has {max_nodes}")
    return LocalChoice(step, sorted(chosen), f"node-local step {step} is held whole by {', '.join(sorted(chosen))}")

"""Saving one checkpoint: snapshot, chunk, hash, write new chunks, fsync, gather tables, commit.

Commit order (the atomicity argument):
1. every rank writes its new chunks into `.tmp-step-N/data/rank-R.bin` and fsyncs file and directory;
2. each rank sends its chunk table to rank 0 over the checkpoint's own gloo group (never the training
   group, so a background save cannot interleave with training collectives);
3. rank 0 writes `index.h5.tmp`, fsyncs, renames it to `index.h5`, fsyncs the directory, renames
   `.tmp-step-N` to `step-N`, fsyncs the root, then replaces `LATEST`;
4. rank 0 applies retention and tells every rank the outcome (and which files retention removed).
A crash before (3) leaves only a `.tmp-*` directory (cleaned at the next start); a checkpoint directory
without `index.h5` is never considered complete.

Fault injection for tests: HPCSCALE_CKPT_FAULT=<point>[@<rank>] kills the process with SIGKILL at one of
`data_written` (before fsync), `data_durable` (before sending tables), `index_written` (before the renames),
`gc` (between deleting files).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from hpcscale.ckpt.faults import fault
from hpcscale.ckpt.format import (
    CHUNK_BYTES,
    INDEX,
    LATEST,
    ChunkRef,
    Index,
    ShardRecord,
    TensorRecord,
    fsync_dir,
    step_dir_name,
    write_index,
)
from hpcscale.ckpt.shards import LocalShard


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is contiguous on CPU."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass(slots=True)
class PendingShard:
    shard: LocalShard
    data: torch.Tensor | None  # CPU copy (async) or the live tensor (sync); None: unchanged, reuse `reuse`
    reuse: list[ChunkRef] | None = None


@dataclass(slots=True)
class SaveResult:
    step: int
    new_bytes: int = 0  # bytes this rank wrote
    referenced_bytes: int = 0  # bytes this rank referenced from earlier checkpoints
    seconds: float = 0.0
    removed_files: list[str] = field(default_factory=list)


class ShardWriter:
    """One rank's side of saving. `known` maps chunk hashes to committed locations (for dedup)."""

    def __init__(self, root: Path, *, rank: int, group: dist.ProcessGroup | None):
        self.root = root
        self.rank = rank
        self.group = group
        self.known: dict[str, ChunkRef] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._versions: dict[str, tuple[int, int]] = {}  # name -> (id of tensor, version) at the last save
        self._last_refs: dict[str, list[ChunkRef]] = {}
        # What the save in flight wrote and saw; adopted only when it commits, so an abandoned snapshot or a
        # failed save can never make a changed tensor look unchanged.
        self._candidate: dict[str, list[ChunkRef]] = {}
        self._candidate_versions: dict[str, tuple[int, int]] = {}

    def snapshot(self, shards: list[LocalShard], *, copy: bool) -> list[PendingShard]:
        """Take what will be written. With `copy`, into reused CPU buffers, so training can go on; tensors not
        modified since the last committed save (same object, same version counter) are not copied at all."""
        out = []
        for s in shards:
            key = f"{s.name}@{s.offset}"
            # A DTensor's in-place ops move the DTensor's counter; in-place ops on its local tensor move only the
            # local tensor's. Either means "changed".
            src = s.source if s.source is not None else s.tensor
            local = getattr(src, "_local_tensor", src)
            version = (id(src), src._version, id(local), local._version)
            if self._versions.get(key) == version and key in self._last_refs:
                out.append(PendingShard(s, None, self._last_refs[key]))
                continue
            if copy:
                buf = self._buffers.get(key)
                if buf is None or buf.shape != s.tensor.shape or buf.dtype != s.tensor.dtype:
                    buf = torch.empty(s.tensor.shape, dtype=s.tensor.dtype, device="cpu", pin_memory=s.tensor.is_cuda)
                    self._buffers[key] = buf
                buf.copy_(s.tensor.detach(), non_blocking=s.tensor.is_cuda)
                out.append(PendingShard(s, buf))
            else:
                out.append(PendingShard(s, s.tensor.detach().cpu()))
            self._candidate_versions[key] = version
        if any(p.data is not None and p.shard.tensor.is_cuda for p in out):
            torch.cuda.synchronize()
        return out

    def write(self, step: int, pending: list[PendingShard]) -> tuple[list[tuple], SaveResult]:
        """Write this rank's new chunks durably; returns its table rows and what it wrote."""
        t0 = time.perf_counter()
        result = SaveResult(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        final_rel = f"{step_dir_name(step)}/data/rank-{self.rank:05d}.bin"
        (tmp / "data").mkdir(parents=True, exist_ok=True)
        rows = []
        fd = None
        offset = 0
        new_here: dict[str, ChunkRef] = {}
        try:
            for p in pending:
                s = p.shard
                if p.data is None:
                    refs = p.reuse or []
                    result.referenced_bytes += sum(c.length for c in refs)
                else:
                    refs = []
                    view = tensor_bytes(p.data)
                    for start in range(0, max(len(view), 1), CHUNK_BYTES):
                        piece = view[start : start + CHUNK_BYTES]
                        digest = xxhash.xxh3_128_hexdigest(piece)
                        ref = self.known.get(digest) or new_here.get(digest)
                        if ref is None:
                            if fd is None:
                                fd = os.open(
                                    tmp / "data" / f"rank-{self.rank:05d}.bin",
                                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                    0o644,
                                )
                            os.write(fd, piece)
                            ref = ChunkRef(digest, final_rel, offset, len(piece))
                            new_here[digest] = ref
                            offset += len(piece)
                            result.new_bytes += len(piece)
                        else:
                            result.referenced_bytes += ref.length
                        refs.append(ref)
                    self._candidate[f"{s.name}@{s.offset}"] = refs
                rows.append((s.name, s.global_shape, dtype_name(s.tensor), s.offset, tuple(s.tensor.shape), refs))
            fault("data_written", self.rank)
            if fd is not None:
                os.fsync(fd)
        finally:
            if fd is not None:
                os.close(fd)
        fsync_dir(tmp / "data")
        fault("data_durable", self.rank)
        result.seconds = time.perf_counter() - t0
        return rows, result

    def committed(self, removed_files: list[str]) -> None:
        """The save in flight is committed: its chunks become known (dedup), minus files retention removed."""
        self._last_refs.update(self._candidate)
        self._versions.update(self._candidate_versions)
        self._candidate_versions.clear()
        for refs in self._candidate.values():
            for ref in refs:
                self.known.setdefault(ref.hash, ref)
        self._candidate.clear()
        if removed_files:
            gone = set(removed_files)
            self.known = {h: r for h, r in self.known.items() if r.file not in gone}
            self._last_refs = {k: v for k, v in self._last_refs.items() if not any(r.file in gone for r in v)}

    def failed(self) -> None:
        """The save in flight did not commit: forget it, and re-read every tensor at the next save."""
        self._candidate.clear()
        self._candidate_versions.clear()

    def adopt(self, index: Index) -> None:
        """Dedup against a checkpoint loaded at start-up."""
        for rec in index.tensors.values():
            for shard in rec.shards:
                for ref in shard.chunks:
                    self.known.setdefault(ref.hash, ref)


def commit(
    root: Path,
    step: int,
    gathered: list[dict],
    *,
    layout: dict,
    parent: str | None,
    trainer_state: dict,
    keep_last: int,
    keep_every: int,
) -> list[str]:
    """Rank 0: build and write the index, rename everything into place, apply retention.
    Returns the data files retention removed."""
    tensors: dict[str, TensorRecord] = {}
    rng = {}
    for part in gathered:
        rng[part["rank"]] = part["rng"]
        for name, gshape, dtype, offset, shape, refs in part["rows"]:
            rec = tensors.setdefault(name, TensorRecord(name, tuple(gshape), dtype))
            rec.shards.append(ShardRecord(tuple(offset), tuple(shape), list(refs)))
    for rec in tensors.values():
        rec.shards.sort(key=lambda s: s.offset)
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}"
    index = Index(step, len(gathered), layout, parent, time.time(), tensors, trainer_state, rng)
    write_index(tmp / f"{INDEX}.tmp", index)
    os.replace(tmp / f"{INDEX}.tmp", tmp / INDEX)
    fsync_dir(tmp)
    fault("index_written", 0)
    final = root / name
    if final.exists():  # never replace a committed checkpoint: later ones may reference its data files
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileExistsError(f"{final} is already committed")
    os.replace(tmp, final)
    fsync_dir(root)
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / LATEST)
    fsync_dir(root)
    from hpcscale.ckpt.retention import apply_retention

    return apply_retention(root, keep_last=keep_last, keep_every=keep_every)


def rng_state() -> dict[str, np.ndarray]:
    out = {"cpu": torch.get_rng_state().numpy().copy()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state().numpy().copy()
    return out

"""Checkpoint operations for the CLI: list, verify, inspect, gc. Torch-free (login nodes stay fast)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from hpcscale.ckpt.format import INDEX, LATEST, Index, committed_steps, read_index, step_dir_name, step_of
from hpcscale.ckpt.retention import apply_retention, plan
from hpcscale.errors import BadInput, VerificationFailure


def checkpoints_root(path: Path) -> Path:
    """A run directory, its checkpoints/ directory, or a step directory -> the checkpoints root."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if (path / INDEX).exists() or path.name.startswith("step-"):
        return path.parent
    if path.is_dir():
        return path
    raise BadInput(f"{path}: no such run or checkpoint directory")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    path: str
    time: float
    bytes: int  # logical size: every chunk it references
    new_bytes: int  # bytes stored in its own data files (what this save wrote)
    layout: dict
    world_size: int
    verified: str  # "ok" (structure checked: files present and long enough) or the problem


def _structure_problem(root: Path, index: Index) -> str | None:
    sizes: dict[str, int] = {}
    for rec in index.tensors.values():
        for shard in rec.shards:
            for c in shard.chunks:
                sizes[c.file] = max(sizes.get(c.file, 0), c.offset + c.length)
    for f, need in sorted(sizes.items()):
        try:
            have = (root / f).stat().st_size
        except FileNotFoundError:
            return f"{f} is missing"
        if have < need:
            return f"{f} is truncated ({have} of {need} bytes)"
    return None


def _info(root: Path, step: int) -> CheckpointInfo:
    d = root / step_dir_name(step)
    try:
        index = read_index(d / INDEX)
    except VerificationFailure as e:
        return CheckpointInfo(step, str(d), 0, 0, 0, {}, 0, str(e))
    own = f"{step_dir_name(step)}/"
    new = sum(c.length for t in index.tensors.values() for s in t.shards for c in s.chunks if c.file.startswith(own))
    return CheckpointInfo(
        step,
        str(d),
        index.created,
        index.total_bytes(),
        new,
        index.layout,
        index.world_size,
        _structure_problem(root, index) or "ok",
    )


def list_checkpoints(path: Path) -> list[CheckpointInfo]:
    root = checkpoints_root(path)
    return [_info(root, step) for step in committed_steps(root)]


def latest(path: Path) -> CheckpointInfo | None:
    """The newest committed checkpoint of a run (LATEST when it names a committed one); reads only that one."""
    root = checkpoints_root(path)
    pointer = root / LATEST
    if pointer.exists():
        step = step_of(pointer.read_text().strip())
        if step is not None and (root / step_dir_name(step) / INDEX).exists():
            return _info(root, step)
    steps = committed_steps(root)
    return _info(root, steps[0]) if steps else None


@dataclass(frozen=True, slots=True)
class VerifyReport:
    path: str
    step: int
    tensors: int
    chunks: int
    bytes: int
    seconds: float


def verify(step_dir: Path, *, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Read every chunk and check its hash. VerificationFailure (exit 3) names the tensor and the chunk."""
    if not (step_dir / INDEX).exists():
        raise VerificationFailure(f"{step_dir}: no {INDEX} (not a committed checkpoint)")
    t0 = time.perf_counter()
    root = step_dir.parent
    index = read_index(step_dir / INDEX)
    problem = _structure_problem(root, index)
    if problem:
        raise VerificationFailure(f"{step_dir}: {problem}")
    total = index.total_bytes()
    done = chunks = 0
    seen: dict[tuple, bool] = {}
    fds: dict[str, int] = {}
    try:
        for name in sorted(index.tensors):
            rec = index.tensors[name]
            for shard in rec.shards:
                for c in shard.chunks:
                    key = (c.file, c.offset, c.length, c.hash)
                    if key not in seen:
                        fd = fds.get(c.file) or fds.setdefault(c.file, os.open(root / c.file, os.O_RDONLY))
                        data = os.pread(fd, c.length, c.offset)
                        if len(data) != c.length or xxhash.xxh3_128_hexdigest(data) != c.hash:
                            raise VerificationFailure(
                                f"{step_dir}: tensor {name}: chunk {c.hash} in {c.file} at offset {c.offset} "
                                + ("is truncated" if len(data) != c.length else "does not match its hash")
                            )
                        seen[key] = True
                    chunks += 1
                    done += c.length
                    if progress:
                        progress(done, total)
    finally:
        for fd in fds.values():
            os.close(fd)
    return VerifyReport(str(step_dir), index.step, len(index.tensors), chunks, total, time.perf_counter() - t0)


def inspect(step_dir: Path) -> dict:
    index = read_index(step_dir / INDEX)
    return {
        "path": str(step_dir),
        "step": index.step,
        "world_size": index.world_size,
        "layout": index.layout,
        "parent": index.parent,
        "created": index.created,
        "hash_algorithm": "xxh3-128",
        "bytes": index.total_bytes(),
        "files": sorted(index.files()),
        "trainer_state": index.trainer_state,
        "tensors": [
            {
                "name": r.name,
                "shape": list(r.global_shape),
                "dtype": r.dtype,
                "shards": len(r.shards),
                "chunks": sum(len(s.chunks) for s in r.shards),
            }
            for r in (index.tensors[n] for n in sorted(index.tensors))
        ],
    }


def gc(path: Path, *, keep: int, every: int, dry_run: bool) -> dict:
    root = checkpoints_root(path)
    kept, removed = plan(committed_steps(root), keep_last=keep, keep_every=every)
    files = apply_retention(root, keep_last=keep, keep_every=every, dry_run=dry_run)
    return {"root": str(root), "kept": kept, "removed": removed, "removed_files": files, "dry_run": dry_run}

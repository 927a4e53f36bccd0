"""Checkpoint operations for the CLI: list, verify, inspect, gc. Torch-free (login nodes stay fast)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from hpcscale.ckpt.format import (
    HASH_ALGORITHM,
    INDEX,
    LATEST,
    VERSION,
    Index,
    committed_steps,
    examine_index,
    open_data_file,
    read_index,
    step_dir_name,
    step_of,
)
from hpcscale.ckpt.retention import apply_retention, plan, read_pins, remove_unfinished
from hpcscale.errors import BadInput, VerificationFailure
from hpcscale.rundir import CHECKPOINTS
from hpcscale.util.verify import VerifyProblem, VerifyReport


def checkpoints_root(path: Path) -> Path:
    """A run directory, its checkpoints/ directory, or a step directory -> the checkpoints root."""
    if (path / CHECKPOINTS).is_dir():
        return path / CHECKPOINTS
    if (path / INDEX).exists() or path.name.startswith("step-"):
        return path.parent
    if path.is_dir():
        return path
    raise BadInput(f"{path}: no such run or checkpoint directory")


def size_text(n: int) -> str:
    """Bytes in binary units: 512 B, 1.5 KiB, 24.0 TiB (TiB the largest)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    path: str
    time: float
    bytes: int  # logical size: every chunk it references
    new_bytes: int  # bytes stored in its own data files (what this save wrote)
    layout: dict
    world_size: int
    verified: str  # "ok" (index checked whole: digest and structure; data files present, long enough) or the problem
    parent: str | None = None  # the checkpoint saved before it in its run: the chain
    origin: str = ""  # its lineage in short: job spec hash, code commit, Slurm job/restart, cross-site round


@dataclass(frozen=True, slots=True)
class FileProblem:
    file: str  # a data file, relative to the checkpoints root
    problem: str

    def __str__(self) -> str:
        return f"{self.file} {self.problem}"


def data_file_problem(root: Path, index: Index) -> FileProblem | None:
    """The first data file that is missing, not a regular file (a symbolic link, a FIFO, a directory), or
    shorter than the chunks in it reach. lstat, as a load opens them (O_NOFOLLOW): what passes here, loads."""
    sizes: dict[str, int] = {}
    for rec in index.tensors.values():
        for shard in rec.shards:
            for c in shard.chunks:
                sizes[c.file] = max(sizes.get(c.file, 0), c.offset + c.length)
    for f, need in sorted(sizes.items()):
        try:
            st = (root / f).lstat()
        except FileNotFoundError:
            return FileProblem(f, "is missing")
        except OSError as e:
            return FileProblem(f, f"cannot be examined ({e.strerror or e})")
        if stat.S_ISLNK(st.st_mode):
            return FileProblem(f, "is a symbolic link, not a regular file (a load refuses to follow it)")
        if not stat.S_ISREG(st.st_mode):
            return FileProblem(f, "is not a regular file")  # a FIFO would block the read forever
        have = st.st_size
        if have < need:
            return FileProblem(f, f"is truncated ({have} of {need} bytes)")
    return None


def _info(root: Path, step: int) -> CheckpointInfo:
    d = root / step_dir_name(step)
    try:
        index = read_index(d / INDEX)
    except VerificationFailure as e:
        return CheckpointInfo(step, str(d), 0, 0, 0, {}, 0, str(e))
    except Exception as e:  # read_index reports a bad index as VerificationFailure; this is a last resort
        return CheckpointInfo(step, str(d), 0, 0, 0, {}, 0, f"{d}: unexpected {type(e).__name__}: {e}")
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
        str(data_file_problem(root, index) or "ok"),
        index.parent,
        _origin(index.trainer_state.get("lineage")),
    )


def _origin(lineage: object) -> str:
    """`job 1a2b3c4d code 5e6f7a8b* slurm 123/1 round 4` (* dirty); empty without lineage."""
    if not isinstance(lineage, dict):
        return ""
    parts = []
    job, code, slurm = lineage.get("job"), lineage.get("code"), lineage.get("slurm")
    if isinstance(job, dict) and isinstance(job.get("sha256"), str):
        parts.append(f"job {job['sha256'][:8]}")
    if isinstance(code, dict) and isinstance(code.get("git_commit"), str):
        parts.append(f"code {code['git_commit'][:8]}{'*' if code.get('dirty') else ''}")
    if isinstance(slurm, dict):
        parts.append(f"slurm {slurm.get('job_id')}/{slurm.get('restart_count')}")
    if type(lineage.get("round")) is int:
        parts.append(f"round {lineage['round']}")
    return " ".join(parts)


def list_checkpoints(path: Path) -> list[CheckpointInfo]:
    root = checkpoints_root(path)
    return [_info(root, step) for step in committed_steps(root)]


def latest(path: Path) -> CheckpointInfo | None:
    """The newest committed checkpoint of a run (LATEST when it names a committed one); reads only that one."""
    root = checkpoints_root(path)
    pointer = root / LATEST
    if pointer.exists():
        from hpcscale.util.bounded import read_bounded

        try:  # a FIFO or /dev/zero planted there is refused, never waited on or read without end
            text = read_bounded(pointer, max_bytes=4096, what="LATEST pointer").decode(errors="replace")
            step = step_of(text.strip())
        except BadInput:
            step = None  # a pointer that cannot be read names nothing: the committed steps decide
        if step is not None and (root / step_dir_name(step) / INDEX).exists():
            return _info(root, step)
    steps = committed_steps(root)
    return _info(root, steps[0]) if steps else None


VERIFY_PIECE = 16 << 20  # a chunk is read and hashed this many bytes at a time: an index may set chunks of 1 GiB


def chunk_verdict(fd: int, c) -> str | None:
    """None when the chunk's bytes are in place with its hash; else what is wrong (a read error included).
    Reads at most VERIFY_PIECE bytes at a time, whatever the chunk's length."""
    h = xxhash.xxh3_128()
    buf = memoryview(np.empty(min(VERIFY_PIECE, c.length), dtype=np.uint8))
    pos = 0
    try:
        while pos < c.length:
            got = os.preadv(fd, [buf[: c.length - pos]], c.offset + pos)
            if got == 0:
                return "is truncated"
            h.update(buf[:got])
            pos += got
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None if h.hexdigest() == c.hash else "does not match its hash"


def verify(step_dir: Path, *, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check the index whole, then read every chunk and check its hash; the report names every problem.

    What a passing report proves is in docs/checkpoint-format.md ("What `ckpt verify` proves"): the index's root
    digest matches its contents and DIGEST; its structure is sound (every tensor tiled by its shards, every
    shard exactly its chunks, offsets and lengths in range); every chunk referenced is in place and has its
    recorded hash. A checkpoint directory without an index raises VerificationFailure (exit 3). Each distinct
    chunk is read once, however many tensors reference it: verify reads what is stored, not what is declared
    (`details`: `declared_bytes`, `stored_bytes`)."""
    if not (step_dir / INDEX).exists():
        raise VerificationFailure(f"{step_dir}: no {INDEX} (not a committed checkpoint)")
    t0 = time.perf_counter()
    root = step_dir.parent
    exam = examine_index(step_dir / INDEX)
    index = exam.index
    report = VerifyReport(
        target=str(step_dir),
        root=str(root),
        items=index.chunk_count() if index else 0,
        bytes=index.total_bytes() if index else 0,
        details={
            "step": index.step if index else step_of(step_dir.name),
            "tensors": len(index.tensors) if index else 0,
            "version": index.version if index else VERSION,
            "digest": exam.digest,
            # what the tensors declare against what the data files hold for them (each distinct chunk once):
            # content addressing may make the first far larger (a tensor of zeros is one chunk), and a load or an
            # export produces the declared bytes
            "declared_bytes": index.total_bytes() if index else None,
            "stored_bytes": index.stored_bytes() if index else None,
        },
    )
    report.problems += [VerifyProblem(path=f"{step_dir.name}/{p.file}", problem=p.problem) for p in exam.problems]
    if index is None:  # nothing the index says can be followed
        report.seconds = time.perf_counter() - t0
        return report
    total = report.bytes
    problem = data_file_problem(root, index)
    if problem:
        report.problems.append(VerifyProblem(path=problem.file, problem=problem.problem))
        report.seconds = time.perf_counter() - t0
        return report
    done = 0
    verdict: dict[tuple, str | None] = {}  # a chunk referenced twice is read once
    fds: dict[str, int | None] = {}  # None: the file could not be opened (reported once)
    try:
        for name in sorted(index.tensors):
            rec = index.tensors[name]
            for shard in rec.shards:
                for c in shard.chunks:
                    key = (c.file, c.offset, c.length, c.hash)
                    if key not in verdict:
                        if c.file not in fds:
                            try:
                                fds[c.file] = open_data_file(root / c.file)
                            except OSError as e:
                                fds[c.file] = None
                                report.problems.append(
                                    VerifyProblem(path=c.file, problem=f"cannot be opened ({e.strerror or e})")
                                )
                        fd = fds[c.file]
                        if fd is None:
                            verdict[key] = "is in a file that cannot be opened"
                        else:
                            verdict[key] = chunk_verdict(fd, c)
                    if verdict[key] is None:
                        report.ok += 1
                    else:
                        report.problems.append(
                            VerifyProblem(
                                path=c.file,
                                problem=f"tensor {name}: chunk {c.hash} at offset {c.offset} {verdict[key]}",
                            )
                        )
                    done += c.length
                    if progress:
                        progress(done, total)
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    report.seconds = time.perf_counter() - t0
    return report


def inspect(step_dir: Path) -> dict:
    index = read_index(step_dir / INDEX)
    return {
        "path": str(step_dir),
        "step": index.step,
        "world_size": index.world_size,
        "layout": index.layout,
        "parent": index.parent,
        "created": index.created,
        "hash_algorithm": HASH_ALGORITHM,
        "version": index.version,
        "digest": index.digest,
        "bytes": index.total_bytes(),
        "stored_bytes": index.stored_bytes(),
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
    """Retention by hand: what `keep`/`every` do not keep goes, except pinned steps (PINNED, a running job's)
    and saves in progress (a .tmp-* whose writer may be running: listed in `unfinished_left`)."""
    root = checkpoints_root(path)
    pins = read_pins(root)
    kept, removed = plan(committed_steps(root), keep_last=keep, keep_every=every, keep=frozenset(pins))
    files = apply_retention(root, keep_last=keep, keep_every=every, dry_run=dry_run)
    return {
        "root": str(root),
        "kept": kept,
        "removed": removed,
        "removed_files": files,
        "pinned": {str(k): v for k, v in sorted(pins.items())},
        "unfinished_left": remove_unfinished(root, dry_run=True),
        "dry_run": dry_run,
    }

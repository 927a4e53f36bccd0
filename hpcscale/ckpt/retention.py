"""Retention and garbage collection. A kept checkpoint is never broken, even by an interrupted gc.

Kept: the newest `keep_last` committed checkpoints, and every checkpoint whose step is a multiple of
`keep_every` (when > 0). Each other checkpoint is removed in an order that is safe to interrupt:
1. its `index.h5` goes first: from then on it is not a checkpoint, only a holder of data files;
2. its data files that no kept checkpoint references are deleted; files a kept checkpoint references stay
   where they are (incremental checkpoints point into older directories);
3. the directory goes once it holds nothing.
Leftover `.tmp-*` directories of crashed saves are removed too, but never one whose writer may still be
writing it: rank 0 of a save marks its `.tmp-*` directory with WRITER (host, pid, process start, boot), and
such a directory is removed only when that process is provably gone (this host, and another boot or no such
process); a writer on another host cannot be checked from here, so its directory stays (`ckpt gc` says so).

Pinned steps are kept whatever the policy says. Pins live on disk, in PINNED beside the checkpoints (a JSON
object: step -> why), so an operator's `hpcscale ckpt gc` honours the pins of a job that is running, not only
the job's own retention (a cross-site start checkpoint round 0 is published from, until round 0 is adopted).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from hpcscale.ckpt.faults import fault
from hpcscale.ckpt.format import DIGEST, INDEX, LATEST, committed_steps, read_index, step_dir_name, step_of
from hpcscale.errors import BadInput, VerificationFailure
from hpcscale.portable.files import atomic_write
from hpcscale.util.bounded import loads_json, read_bounded


def plan(
    steps: list[int], *, keep_last: int, keep_every: int, keep: frozenset[int] = frozenset()
) -> tuple[list[int], list[int]]:
    """(kept, removed) steps, newest first. `keep`: steps kept whatever the policy says (a cross-site start
    checkpoint the aggregator has not published yet)."""
    newest = sorted(steps, reverse=True)
    kept = [s for i, s in enumerate(newest) if i < keep_last or (keep_every > 0 and s % keep_every == 0) or s in keep]
    return kept, [s for s in newest if s not in kept]


PINNED = "PINNED"
WRITER = "WRITER"
UNMARKED_STALE_S = 3600  # a .tmp-* without WRITER (from before the mark) is a crashed save's after an hour


def read_pins(root: Path) -> dict[int, str]:
    """step -> why, from root/PINNED ({} when there is none or it cannot be read: nothing pinned)."""
    from hpcscale.util.bounded import load_json

    if not (root / PINNED).is_file():
        return {}
    try:
        doc = load_json(root / PINNED, max_bytes=1 << 20, what="pin list")
    except Exception:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {int(k): str(v)[:200] for k, v in doc.items() if isinstance(k, str) and k.isdigit()}


def write_pins(root: Path, pins: dict[int, str]) -> None:
    """root/PINNED replaced whole (temporary file, fsync, rename); removed when nothing is pinned."""
    path = root / PINNED
    if not pins:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    atomic_write(path, json.dumps({str(k): v for k, v in sorted(pins.items())}))


def mark_writer(tmp_dir: Path) -> None:
    """WRITER in a save's .tmp-* directory: who is writing it (this process), so gc leaves it alone."""
    from hpcscale.portable.lock import _boot_id, process_start_time

    doc = {"host": os.uname().nodename, "pid": os.getpid(), "start": process_start_time(os.getpid()),
           "boot": _boot_id(), "since": int(time.time())}  # fmt: skip
    (tmp_dir / WRITER).write_text(json.dumps(doc))


def writer_alive(tmp_dir: Path) -> str | None:
    """Why `tmp_dir` (a .tmp-* save directory) may still be being written (None: its writer is gone)."""
    from hpcscale.portable.lock import _boot_id, process_alive

    if not os.path.lexists(tmp_dir / WRITER):
        age = time.time() - tmp_dir.stat().st_mtime
        return None if age > UNMARKED_STALE_S else f"unmarked and {age:.0f} s old: maybe a save starting now"
    try:  # bounded, and a FIFO or device there is refused, never waited on
        doc = loads_json(read_bounded(tmp_dir / WRITER, max_bytes=64 << 10, what="WRITER mark"), source="WRITER")
    except BadInput:  # read_bounded and loads_json say every failure so (a mark that went meanwhile too)
        return "its WRITER mark cannot be read"
    if not isinstance(doc, dict):
        return "its WRITER mark is not an object"
    if doc.get("host") != os.uname().nodename:
        return f"written from host {doc.get('host')} (pid {doc.get('pid')}), which cannot be checked from here"
    if doc.get("boot") != _boot_id():
        return None
    pid = doc.get("pid")
    if type(pid) is int and pid > 0 and process_alive(pid, doc.get("start")):
        return f"its writer, pid {pid}, is running"
    return None


def referenced_files(root: Path, steps: list[int]) -> set[str]:
    out: set[str] = set()
    for s in steps:
        out |= read_index(root / step_dir_name(s) / INDEX).files()
    return out


def remove_unfinished(root: Path, *, dry_run: bool = False, all_of_them: bool = False) -> list[str]:
    """Remove the .tmp-* save directories whose writer is provably gone (`all_of_them`: every one, what the job
    that owns them does: at its start, and after each commit, no save of its own is in progress; then also the
    temporaries of LATEST a killed commit left); returns those left, with why."""
    left = []
    for tmp in sorted(root.glob(".tmp-*")):
        if not tmp.is_dir() or tmp.is_symlink():
            continue
        why = None if all_of_them else writer_alive(tmp)
        if why is not None:
            left.append(f"{tmp.name}: {why}")
        elif not dry_run:
            shutil.rmtree(tmp, ignore_errors=True)
    if all_of_them and not dry_run:  # LATEST's temporaries of a commit killed before its rename (the one
        for stale in root.glob(f".{LATEST}.*.tmp"):  # writer of LATEST is the thread that calls this)
            if stale.is_file() and not stale.is_symlink():
                stale.unlink(missing_ok=True)
    return left


def apply_retention(
    root: Path,
    *,
    keep_last: int,
    keep_every: int,
    dry_run: bool = False,
    keep: frozenset[int] = frozenset(),
    own_saves: bool = False,
) -> list[str]:
    """Remove what the policy does not keep (never a pinned step, root/PINNED's or `keep`); returns removed
    data files (relative to root). own_saves: the caller is the job writing here, with no save in progress,
    so every .tmp-* is a crashed save's; otherwise (`ckpt gc`) only those whose writer is provably gone go."""
    keep = keep | frozenset(read_pins(root))
    kept, removed = plan(committed_steps(root), keep_last=keep_last, keep_every=keep_every, keep=keep)
    orphans = [p for p in root.iterdir() if step_of(p.name) is not None and not (p / INDEX).exists()]
    if not removed and not orphans:
        remove_unfinished(root, dry_run=dry_run, all_of_them=own_saves)
        return []
    try:
        needed = referenced_files(root, kept)
    except VerificationFailure:
        return []  # a kept index is unreadable: deleting anything now could lose the data it points to
    gone: list[str] = []
    holders = [root / step_dir_name(s) for s in removed]
    # Directories left by an interrupted gc (index already gone) still hold files to collect.
    holders += orphans
    for d in holders:
        if dry_run:
            gone += [str(f.relative_to(root)) for f in (d / "data").glob("*") if str(f.relative_to(root)) not in needed]
            continue
        (d / INDEX).unlink(missing_ok=True)
        (d / DIGEST).unlink(missing_ok=True)  # no longer the digest of anything
        for f in sorted((d / "data").glob("*")):
            rel = str(f.relative_to(root))
            if rel not in needed:
                f.unlink()
                gone.append(rel)
                fault("gc", 0)
        if not any((d / "data").glob("*")):
            shutil.rmtree(d, ignore_errors=True)
    remove_unfinished(root, dry_run=dry_run, all_of_them=own_saves)
    return gone

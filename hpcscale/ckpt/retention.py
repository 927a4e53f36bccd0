"""Retention and garbage collection. A kept checkpoint is never broken, even by an interrupted gc.

Kept: the newest `keep_last` committed checkpoints, and every checkpoint whose step is a multiple of
`keep_every` (when > 0). Each other checkpoint is removed in an order that is safe to interrupt:
1. its `index.h5` goes first: from then on it is not a checkpoint, only a holder of data files;
2. its data files that no kept checkpoint references are deleted; files a kept checkpoint references stay
   where they are (incremental checkpoints point into older directories);
3. the directory goes once it holds nothing.
Leftover `.tmp-*` directories of crashed saves are removed too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcscale.ckpt.faults import fault
from hpcscale.ckpt.format import DIGEST, INDEX, committed_steps, read_index, step_dir_name, step_of
from hpcscale.errors import VerificationFailure


def plan(
    steps: list[int], *, keep_last: int, keep_every: int, keep: frozenset[int] = frozenset()
) -> tuple[list[int], list[int]]:
    """(kept, removed) steps, newest first. `keep`: steps kept whatever the policy says (a cross-site start
    checkpoint the aggregator has not published yet)."""
    newest = sorted(steps, reverse=True)
    kept = [s for i, s in enumerate(newest) if i < keep_last or (keep_every > 0 and s % keep_every == 0) or s in keep]
    return kept, [s for s in newest if s not in kept]


def referenced_files(root: Path, steps: list[int]) -> set[str]:
    out: set[str] = set()
    for s in steps:
        out |= read_index(root / step_dir_name(s) / INDEX).files()
    return out


def apply_retention(
    root: Path, *, keep_last: int, keep_every: int, dry_run: bool = False, keep: frozenset[int] = frozenset()
) -> list[str]:
    """Remove what the policy does not keep; returns removed data files (relative to root)."""
    kept, removed = plan(committed_steps(root), keep_last=keep_last, keep_every=keep_every, keep=keep)
    orphans = [p for p in root.iterdir() if step_of(p.name) is not None and not (p / INDEX).exists()]
    if not removed and not orphans:
        if not dry_run:
            for tmp in root.glob(".tmp-*"):
                shutil.rmtree(tmp, ignore_errors=True)
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
    if not dry_run:
        for tmp in root.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
    return gone

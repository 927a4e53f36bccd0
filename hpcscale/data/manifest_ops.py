"""`hpcscale manifest build | diff | verify`: what a dataset directory holds, proven by hashes.

Hashing runs in a thread pool (reading and xxh3 both release the GIL; xxh3 is much faster than a
disk, so the disk is the limit, not the hash). A rebuild reuses the hash of every file whose size and mtime are
unchanged since the previous manifest, unless rehash is asked for.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcscale.data.manifest import (
    MANIFEST_NAME,
    DirEntry,
    FileEntry,
    Manifest,
    TokenDataset,
    TokenShard,
    hash_file,
    hasher,
    read_manifest,
    write_manifest,
)
from hpcscale.errors import BadInput
from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import XXH128, hash_fd
from hpcscale.portable.paths import MODE_BITS, STATE_DIR, check_relpath, is_part_name, within
from hpcscale.portable.source import Source
from hpcscale.portable.threads import parallel_map
from hpcscale.util.progress import Progress
from hpcscale.util.verify import VerifyProblem, VerifyReport

ITEMSIZE = {"uint8": 1, "uint16": 2, "uint32": 4}


def default_jobs() -> int:
    return min(16, 2 * (os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class NotListed:
    """Something under the root that the manifest does not list, and why (every one is reported by name)."""

    path: str  # relative to the root; a directory stands for everything under it
    reason: str


@dataclass(slots=True)
class BuildStats:
    files: int = 0
    bytes: int = 0
    hashed: int = 0
    hashed_bytes: int = 0
    reused: int = 0
    not_listed: list[NotListed] = field(default_factory=list)
    seconds: float = 0.0


STATE = "hpcscale stage's own state at a destination root"
PART = "a part file of a transfer in progress (hpcscale stage)"


@dataclass(slots=True)
class Scan:
    files: list[tuple[str, os.stat_result]]  # regular files (relative path, stat), sorted by path
    dirs: list[DirEntry]  # every directory under the root, empty ones too, sorted by path
    not_listed: list[NotListed]


def scan(root: Path, exclude: set[str]) -> Scan:
    """Every regular file under root as (relative path, stat), sorted, symlinks followed only inside root; every
    directory with its mode; and everything else found, with the reason it is not listed: staging state at
    the root, part files, names the manifest's path rule refuses (a backslash, not UTF-8), symlinked
    directories, sockets, fifos, unreadable directories. A symlink leading out of root is BadInput naming it."""
    real_root = os.path.realpath(root)
    files: list[tuple[str, os.stat_result]] = []
    dirs: list[DirEntry] = []
    skipped: list[NotListed] = []
    stack = [("", real_root)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        try:
            it = os.scandir(abs_dir)
        except OSError as e:
            skipped.append(NotListed(rel_dir or ".", f"directory cannot be listed ({e.strerror})"))
            continue
        with it:
            for de in it:
                rel = f"{rel_dir}/{de.name}" if rel_dir else de.name
                if rel in exclude:
                    continue
                if rel == STATE_DIR:
                    skipped.append(NotListed(rel, STATE))
                    continue
                if is_part_name(de.name):
                    skipped.append(NotListed(rel, PART))
                    continue
                if de.is_symlink():
                    target = os.path.realpath(de.path)
                    if not within(target, real_root):
                        raise BadInput(f"{root}/{_shown(rel)}: symlink leads out of the root (-> {_shown(target)})")
                    try:
                        st = os.stat(target)
                    except OSError:
                        raise BadInput(f"{root}/{_shown(rel)}: dangling symlink (-> {_shown(target)})") from None
                    if stat.S_ISREG(st.st_mode):
                        _add(files, skipped, rel, st)
                    else:
                        skipped.append(NotListed(rel, "a symlink to a directory or special file"))
                    continue
                if de.is_dir(follow_symlinks=False):
                    problem = check_relpath(rel)
                    if problem is not None:
                        skipped.append(NotListed(rel, f"the manifest's path rule refuses it: {problem}"))
                        continue
                    dirs.append(DirEntry(rel, de.stat(follow_symlinks=False).st_mode & MODE_BITS))
                    stack.append((rel, de.path))
                elif de.is_file(follow_symlinks=False):
                    _add(files, skipped, rel, de.stat(follow_symlinks=False))
                else:
                    skipped.append(NotListed(rel, "not a regular file (a socket, FIFO or device)"))
    files.sort(key=lambda t: t[0])
    dirs.sort(key=lambda d: d.path)
    skipped.sort(key=lambda n: n.path)
    return Scan(files, dirs, skipped)


def _add(files: list, skipped: list[NotListed], rel: str, st: os.stat_result) -> None:
    problem = check_relpath(rel)  # the reader's own rule: build never writes what read_manifest refuses
    if problem is None:
        files.append((rel, st))
    else:
        skipped.append(NotListed(rel, f"the manifest's path rule refuses it: {problem}"))


def _shown(text: str) -> str:
    """A path for a message, printable even where its name is not UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _hash_one(root: str, rel: str, algorithm: str, progress: Progress) -> str | OSError:
    try:
        digest = hash_file(os.path.join(root, rel), algorithm, on_bytes=lambda n: progress.advance(nbytes=n))
    except OSError as e:  # unreadable (permissions, an I/O error): reported as not listed, by name
        return e
    finally:
        progress.advance(files=1)
    return digest


def build(
    root: Path,
    out: Path | None = None,
    *,
    algorithm: str = XXH128,
    rehash: bool = False,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> tuple[Manifest, BuildStats]:
    """Build (or refresh) the manifest of `root` and write it atomically to `out` (root/manifest.json)."""
    t0 = time.perf_counter()
    progress = progress or Progress()
    hasher(algorithm)
    root = Path(os.path.realpath(root))
    if not root.is_dir():
        raise BadInput(f"{root}: no such directory")
    out = Path(out) if out else root / MANIFEST_NAME
    previous: Manifest | None = None
    if out.exists():
        try:
            previous = read_manifest(out)
        except BadInput:
            previous = None  # rebuilt from scratch below
    exclude: set[str] = set()
    out_real = os.path.realpath(out)
    if within(out_real, str(root)):
        exclude.add(os.path.relpath(out_real, root))
    found = scan(root, exclude)
    listing, skipped = found.files, found.not_listed
    old = {f.path: f for f in previous.files} if previous and previous.hash_algorithm == algorithm else {}
    stats = BuildStats(not_listed=skipped)
    entries: list[FileEntry | None] = []
    todo: list[int] = []
    for i, (rel, st) in enumerate(listing):
        prev = old.get(rel)
        if prev is not None and not rehash and prev.size == st.st_size and prev.mtime_ns == st.st_mtime_ns:
            entries.append(FileEntry(rel, st.st_size, st.st_mtime_ns, prev.hash, st.st_mode & MODE_BITS))
            stats.reused += 1
        else:
            entries.append(None)
            todo.append(i)
    stats.hashed = len(todo)
    stats.hashed_bytes = sum(listing[i][1].st_size for i in todo)
    progress.start(len(todo), stats.hashed_bytes)
    digests = parallel_map(
        lambda i: _hash_one(str(root), listing[i][0], algorithm, progress), todo, jobs or default_jobs()
    )
    for i, digest in zip(todo, digests, strict=True):
        rel, st = listing[i]
        if isinstance(digest, OSError):
            skipped.append(NotListed(rel, f"cannot be read ({digest.strerror})"))
            stats.hashed -= 1
            stats.hashed_bytes -= st.st_size
        else:
            entries[i] = FileEntry(rel, st.st_size, st.st_mtime_ns, digest, st.st_mode & MODE_BITS)
    skipped.sort(key=lambda n: n.path)
    files = [e for e in entries if e is not None]
    stats.files = len(files)
    stats.bytes = sum(f.size for f in files)
    dataset = _refresh_dataset(previous, {f.path: f for f in files}, out) if previous else None
    manifest = Manifest(algorithm, files, dataset, previous.meta if previous else {}, found.dirs)
    write_manifest(out, manifest)
    stats.seconds = time.perf_counter() - t0
    return manifest, stats


def _refresh_dataset(previous: Manifest, files: dict[str, FileEntry], out: Path) -> TokenDataset | None:
    """Keep a token dataset's description, its sample counts recomputed from the shards' sizes."""
    ds = previous.dataset
    if ds is None:
        return None
    shards = []
    per_sample = ds.sample_len * ITEMSIZE[ds.dtype]
    for s in ds.shards:
        f = files.get(s.path)
        if f is None:
            raise BadInput(f"{out}: dataset shard '{s.path}' is no longer in the directory")
        if f.size % per_sample:
            raise BadInput(f"{out}: dataset shard '{s.path}' holds {f.size} bytes, not whole samples of {per_sample}")
        shards.append(TokenShard(s.path, f.size // per_sample))
    return TokenDataset(ds.dtype, ds.vocab_size, ds.sample_len, shards)


@dataclass(slots=True)
class Diff:
    added: list[FileEntry]
    removed: list[FileEntry]
    changed: list[tuple[FileEntry, FileEntry]]
    unchanged: int

    def to_json(self) -> dict:
        return {
            "added": [f.path for f in self.added],
            "removed": [f.path for f in self.removed],
            "changed": [{"path": a.path, "size": [a.size, b.size], "hash": [a.hash, b.hash]} for a, b in self.changed],
            "unchanged": self.unchanged,
        }


def diff(a: Manifest, b: Manifest, a_name: str = "A", b_name: str = "B") -> Diff:
    """What changed from manifest a to manifest b, by path; content compared by size and hash."""
    if a.hash_algorithm != b.hash_algorithm:
        raise BadInput(
            f"{a_name} hashes with {a.hash_algorithm} and {b_name} with {b.hash_algorithm}: "
            f"their hashes cannot be compared (rebuild one with --algorithm {a.hash_algorithm})"
        )
    old = {f.path: f for f in a.files}
    new = {f.path: f for f in b.files}
    changed = [
        (old[p], new[p])
        for p in sorted(old.keys() & new.keys())
        if (old[p].size, old[p].hash) != (new[p].size, new[p].hash)
    ]
    return Diff(
        added=[new[p] for p in sorted(new.keys() - old.keys())],
        removed=[old[p] for p in sorted(old.keys() - new.keys())],
        changed=changed,
        unchanged=len(old.keys() & new.keys()) - len(changed),
    )


def verify(
    manifest: Manifest,
    root: Path,
    *,
    jobs: int | None = None,
    progress: Progress | None = None,
    target: str = "",
) -> VerifyReport:
    """Hash every file the manifest lists under root. Problems (damage, exit 3): missing, size, hash, each
    named. A file that is there but cannot be read (permissions, an I/O error) is not damage: it is listed in
    `details["unreadable"]` ({path, problem}), and the command exits 1 for it when nothing is damaged.
    A path leading through a symlink out of root, or a listed path that is not a regular file (a FIFO is
    refused, never waited on), is BadInput."""
    t0 = time.perf_counter()
    progress = progress or Progress()
    try:
        source = Source(str(root))
    except StageError as e:  # "ROOT: no such directory"
        raise BadInput(str(e)) from None
    report = VerifyReport(
        target=target,
        root=str(root),
        items=len(manifest.files),
        bytes=sum(f.size for f in manifest.files),
        details={"files": len(manifest.files), "unreadable": []},
    )
    progress.start(report.items, report.bytes)

    def check(f: FileEntry) -> tuple[str, str] | None:
        try:
            fd = source.open(f.path)
        except StageError as e:
            if e.kind == "input":
                raise BadInput(f"{root}: {e}") from None
            return ("damage", "missing") if e.kind == "missing" else ("unreadable", str(e))
        try:
            size = os.fstat(fd).st_size
            if size != f.size:
                progress.advance(files=1, nbytes=f.size)
                return "damage", f"size {size}, manifest says {f.size}"
            digest, _ = hash_fd(fd, manifest.hash_algorithm, limit=size)  # size known: no second fstat
        except OSError as e:
            return "unreadable", f"{root}/{f.path}: cannot be read ({e.strerror})"
        finally:
            os.close(fd)
        progress.advance(files=1, nbytes=f.size)
        return None if digest == f.hash else ("damage", f"hash {digest}, manifest says {f.hash}")

    for f, found in zip(manifest.files, parallel_map(check, manifest.files, jobs or default_jobs()), strict=True):
        if found is None:
            report.ok += 1
        elif found[0] == "damage":
            report.problems.append(VerifyProblem(path=f.path, problem=found[1]))
        else:
            report.details["unreadable"].append({"path": f.path, "problem": found[1]})
    report.seconds = time.perf_counter() - t0
    return report

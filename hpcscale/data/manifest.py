"""The dataset manifest: what a dataset directory holds, proven by hashes. Format: docs/manifest-format.md.

One JSON document (`manifest.json` at the dataset root) that the data loader and `hpcscale stage` both read.
Paths are relative, use `/`, and may not be absolute, contain `..`, or be empty: a manifest from another
site can name nothing outside its root. The path rule, the field rules (size, mtime_ns, hash, mode) and the
hash algorithms are hpcscale.portable's (paths.check_relpath, paths.check_size/check_mtime/check_mode,
hashing.check_digest, hashing.HASH_ALGORITHMS): the staging agent at another site applies the very same code.

A manifest is read through hpcscale.util.bounded (size, nesting, non-finite numbers refused while parsing),
then every field is checked: whatever a reader accepts is safe to hand to a Sink, and every refusal is
BadInput (exit 2) naming the manifest and the entry.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcscale.errors import BadInput
from hpcscale.portable import hashing, paths
from hpcscale.portable.errors import StageError
from hpcscale.portable.files import atomic_write, open_regular
from hpcscale.portable.hashing import HASH_ALGORITHMS
from hpcscale.util.bounded import loads_json, read_bounded

FORMAT = "hpcscale-manifest"
VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative, '/'-separated
    size: int
    mtime_ns: int
    hash: str
    mode: int | None = None  # permission bits (0o777 at most); None: a manifest written before modes were kept


@dataclass(frozen=True, slots=True)
class DirEntry:
    """A directory under the root (empty ones too) and its permission bits, so that a copy keeps both."""

    path: str  # relative, '/'-separated
    mode: int  # 0o777 at most


@dataclass(frozen=True, slots=True)
class TokenShard:
    path: str  # a FileEntry's path
    samples: int


TOKEN_DTYPES = ("uint8", "uint16", "uint32")


@dataclass(frozen=True, slots=True)
class TokenDataset:
    """Token shards for the reference trainer: each shard is raw `dtype` tokens, `samples` × `sample_len`."""

    dtype: str  # one of TOKEN_DTYPES; a manifest without one was written when every tokenizer's ids were uint16
    vocab_size: int  # every id is below it (the largest id + 1)
    sample_len: int  # tokens per sample: the longest seq_len it serves is sample_len - 1
    shards: list[TokenShard]

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)


@dataclass(frozen=True, slots=True)
class Manifest:
    hash_algorithm: str
    files: list[FileEntry]
    dataset: TokenDataset | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    dirs: list[DirEntry] = field(default_factory=list)  # empty: a manifest written before directories were kept

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "hash_algorithm": self.hash_algorithm,
            "files": [_file_json(f) for f in self.files],
        }
        if self.dirs:
            doc["dirs"] = [{"path": d.path, "mode": d.mode} for d in self.dirs]
        if self.dataset is not None:
            doc["dataset"] = {"kind": "tokens", **asdict(self.dataset)}
        if self.meta:
            doc["meta"] = self.meta
        return doc


def _file_json(f: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns, "hash": f.hash}
    if f.mode is not None:
        doc["mode"] = f.mode
    return doc


def check_relpath(path: Any) -> str | None:
    """None if `path` is a safe relative path, else why not (the staging agent applies the same rule)."""
    return paths.check_relpath(path)


def hasher(algorithm: str):
    """A new hash object (update/hexdigest) for a manifest's algorithm."""
    try:
        return hashing.hasher(algorithm)
    except StageError as e:
        raise BadInput(str(e)) from None


def hash_file(path: Path | str, algorithm: str, on_bytes=None) -> str:
    """Hex digest of a whole file; `on_bytes(n)` is told of each block hashed (progress)."""
    hasher(algorithm)
    fd, _ = open_regular(path)  # a FIFO or a device planted in a dataset is refused (NotRegularFile), never waited on
    try:
        return hashing.hash_fd(fd, algorithm, on_bytes=on_bytes)[0]
    finally:
        os.close(fd)


def entry_for(root: Path, rel: str, algorithm: str) -> FileEntry:
    st = (root / rel).stat()
    return FileEntry(rel, st.st_size, st.st_mtime_ns, hash_file(root / rel, algorithm), st.st_mode & paths.MODE_BITS)


def manifest_text(manifest: Manifest) -> str:
    """The manifest as JSON text, one file entry per line (diffable; 100k files stay a few MB)."""
    doc = manifest.to_json()
    files = doc.pop("files")
    dirs = doc.pop("dirs", None)
    head = json.dumps(doc, indent=1)[:-2]  # drop the closing brace
    if dirs:
        head += ',\n "dirs": [\n  ' + ",\n  ".join(json.dumps(d, separators=(", ", ": ")) for d in dirs) + "\n ]"
    lines = ",\n  ".join(json.dumps(f, separators=(", ", ": ")) for f in files)
    return f'{head},\n "files": [\n  {lines}\n ]\n}}\n' if files else f'{head},\n "files": []\n}}\n'


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Atomically: a reader sees the old manifest or the new one, never half of one."""
    atomic_write(path, manifest_text(manifest))


MAX_MANIFEST_BYTES = 1 << 30  # a million-file manifest is ~100 MB


def read_manifest_text(path: Path) -> tuple[Manifest, str]:
    """The manifest at `path` and its exact text (what `hpcscale stage` writes at the destination), read once:
    a FIFO or device is refused without waiting on it, then parsed under bounds and validated."""
    path = Path(path)
    data = read_bounded(path, max_bytes=MAX_MANIFEST_BYTES, what="manifest")
    doc = loads_json(data, source=str(path), max_bytes=MAX_MANIFEST_BYTES)
    return parse_manifest(doc, str(path)), data.decode("utf-8")


def read_manifest(path: Path) -> Manifest:
    """Parse and validate; every problem is BadInput naming the manifest and the entry."""
    return read_manifest_text(path)[0]


def _int(value: Any) -> bool:
    return type(value) is int


def parse_manifest(doc: Any, where: str) -> Manifest:
    """Validate a parsed manifest document; every problem is BadInput naming `where` and the entry."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BadInput(f"{where}: not an hpcscale manifest (format must be '{FORMAT}')")
    if doc.get("version") != VERSION or not _int(doc.get("version")):
        raise BadInput(
            f"{where}: version {str(doc.get('version'))[:40]} is not supported (this hpcscale reads {VERSION})"
        )
    algorithm = doc.get("hash_algorithm")
    if not isinstance(algorithm, str) or algorithm not in HASH_ALGORITHMS:
        shown = str(algorithm)[:40]
        raise BadInput(f"{where}: hash_algorithm: unknown '{shown}' (known: {', '.join(HASH_ALGORITHMS)})")
    raw = doc.get("files", [])
    if not isinstance(raw, list):
        raise BadInput(f"{where}: files: expected a list of file entries, got {type(raw).__name__}")
    files = []
    seen: set[str] = set()
    digits, int64, relpath = hashing.HEX_DIGITS[algorithm], paths.INT64, paths.check_relpath
    for i, entry in enumerate(raw):
        if type(entry) is not dict:
            raise BadInput(f"{where}: files[{i}]: expected an object")
        rel = entry.get("path")
        problem = relpath(rel)
        if problem:
            raise BadInput(f"{where}: files[{i}]: {problem}")
        if rel in seen:
            raise BadInput(f"{where}: files[{i}]: path '{rel}' is listed twice")
        seen.add(rel)
        size, mtime_ns, digest, mode = entry.get("size"), entry.get("mtime_ns", 0), entry.get("hash"), entry.get("mode")
        # the common case in one expression (a million entries must parse fast); the messages come from the rules
        if not (
            type(size) is int
            and 0 <= size < int64
            and type(mtime_ns) is int
            and -int64 <= mtime_ns < int64
            and type(digest) is str
            and len(digest) == digits
            and not digest.strip(_HEX)
            and (mode is None or (type(mode) is int and 0 <= mode <= paths.MODE_BITS))
        ):
            _refuse_entry(entry, algorithm, f"{where}: files[{i}] ({rel})")
        files.append(FileEntry(rel, size, mtime_ns, digest, mode))
    dirs = _read_dirs(doc.get("dirs", []), where, seen)
    nested = paths.under_a_file(seen, [d.path for d in dirs])
    if nested:
        raise BadInput(f"{where}: '{nested[0]}' lies under '{nested[1]}', which is listed as a file")
    dataset = None
    if "dataset" in doc:
        dataset = _read_dataset(doc["dataset"], where, seen)
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        raise BadInput(f"{where}: meta: expected an object, got {type(meta).__name__}")
    return Manifest(algorithm, files, dataset, meta, dirs)


_HEX = "0123456789abcdef"


def _refuse_entry(entry: dict, algorithm: str, where: str) -> None:
    for name in ("size", "hash"):
        if name not in entry:
            raise BadInput(f"{where}: missing field '{name}'")
    problem = (
        paths.check_size(entry["size"])
        or paths.check_mtime(entry.get("mtime_ns", 0))
        or hashing.check_digest(algorithm, entry["hash"])
        or paths.check_mode(entry.get("mode"))
    )
    raise BadInput(f"{where}: {problem}")


def _read_dirs(raw: Any, where: str, files: set[str]) -> list[DirEntry]:
    if not isinstance(raw, list):
        raise BadInput(f"{where}: dirs: expected a list of directory entries, got {type(raw).__name__}")
    dirs = []
    seen: set[str] = set()
    for i, entry in enumerate(raw):
        key = f"dirs[{i}]"
        if not isinstance(entry, dict):
            raise BadInput(f"{where}: {key}: expected an object")
        problem = paths.check_dir_entry([entry.get("path"), entry.get("mode")])
        if problem:
            raise BadInput(f"{where}: {key}: {problem}")
        if entry["path"] in seen or entry["path"] in files:
            raise BadInput(f"{where}: {key}: path '{entry['path']}' is listed twice")
        seen.add(entry["path"])
        dirs.append(DirEntry(entry["path"], entry["mode"]))
    return dirs


def _read_dataset(d: Any, where: str, paths: set[str]) -> TokenDataset:
    if not isinstance(d, dict) or d.get("kind") != "tokens":
        raise BadInput(f"{where}: dataset: only kind 'tokens' is known")
    shards_raw = d.get("shards")
    if not isinstance(shards_raw, list) or not all(isinstance(s, dict) for s in shards_raw):
        raise BadInput(f"{where}: dataset.shards: expected a list of objects")
    for name in ("vocab_size", "sample_len"):
        if not _int(d.get(name)) or d[name] <= 0:
            raise BadInput(f"{where}: dataset.{name}: {str(d.get(name))[:40]} is not a positive integer")
    for i, s in enumerate(shards_raw):
        if not isinstance(s.get("path"), str) or not _int(s.get("samples")) or s["samples"] < 0:
            raise BadInput(f"{where}: dataset.shards[{i}]: needs a path and a whole number of samples")
    shards = [TokenShard(s["path"], s["samples"]) for s in shards_raw]
    ds = TokenDataset(str(d.get("dtype", "uint16")), d["vocab_size"], d["sample_len"], shards)
    if ds.dtype not in TOKEN_DTYPES:
        raise BadInput(f"{where}: dataset.dtype: {ds.dtype[:40]!r} is not uint8, uint16 or uint32")
    for i, s in enumerate(ds.shards):
        if s.path not in paths:
            raise BadInput(f"{where}: dataset.shards[{i}]: '{s.path}' is not in files")
    return ds

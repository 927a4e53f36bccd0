"""The dataset manifest: what a dataset directory holds, proven by hashes. Format: docs/manifest-format.md.

One JSON document (`manifest.json` at the dataset root) that the data loader and `hpcscale stage` both read.
Paths are relative, use `/`, and may not be absolute, contain `..`, or be empty: a manifest from another
site can name nothing outside its root. The path rule and the hash algorithms are hpcscale.portable's
(paths.check_relpath, hashing.HASH_ALGORITHMS): the staging agent at another site applies the very same code.
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
from hpcscale.portable.hashing import HASH_ALGORITHMS

FORMAT = "hpcscale-manifest"
VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str  # relative, '/'-separated
    size: int
    mtime_ns: int
    hash: str


@dataclass(frozen=True, slots=True)
class TokenShard:
    path: str  # a FileEntry's path
    samples: int


@dataclass(frozen=True, slots=True)
class TokenDataset:
    """Token shards for the reference trainer: each shard is raw `dtype` tokens, `samples` × `sample_len`."""

    dtype: str
    vocab_size: int
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

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "hash_algorithm": self.hash_algorithm,
            "files": [{"path": f.path, "size": f.size, "mtime_ns": f.mtime_ns, "hash": f.hash} for f in self.files],
        }
        if self.dataset is not None:
            doc["dataset"] = {"kind": "tokens", **asdict(self.dataset)}
        if self.meta:
            doc["meta"] = self.meta
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
    fd = os.open(path, os.O_RDONLY)
    try:
        return hashing.hash_fd(fd, algorithm, on_bytes=on_bytes)[0]
    finally:
        os.close(fd)


def entry_for(root: Path, rel: str, algorithm: str) -> FileEntry:
    st = (root / rel).stat()
    return FileEntry(rel, st.st_size, st.st_mtime_ns, hash_file(root / rel, algorithm))


def manifest_text(manifest: Manifest) -> str:
    """The manifest as JSON text, one file entry per line (diffable; 100k files stay a few MB)."""
    doc = manifest.to_json()
    files = doc.pop("files")
    head = json.dumps(doc, indent=1)[:-2]  # drop the closing brace
    lines = ",\n  ".join(json.dumps(f, separators=(", ", ": ")) for f in files)
    return f'{head},\n "files": [\n  {lines}\n ]\n}}\n' if files else f'{head},\n "files": []\n}}\n'


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Atomically: a reader sees the old manifest or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(manifest_text(manifest))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: Path) -> Manifest:
    """Parse and validate; every problem is BadInput naming the manifest and the entry."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{path}: no such manifest") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not a JSON manifest ({e})") from None
    where = str(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BadInput(f"{where}: not an hpcscale manifest (format must be '{FORMAT}')")
    if doc.get("version") != VERSION:
        raise BadInput(f"{where}: version {doc.get('version')!r} is not supported (this hpcscale reads {VERSION})")
    algorithm = doc.get("hash_algorithm")
    if algorithm not in HASH_ALGORITHMS:
        raise BadInput(f"{where}: hash_algorithm: unknown '{algorithm}' (known: {', '.join(HASH_ALGORITHMS)})")
    files = []
    seen = set()
    for i, entry in enumerate(doc.get("files") or []):
        key = f"files[{i}]"
        if not isinstance(entry, dict):
            raise BadInput(f"{where}: {key}: expected an object")
        problem = check_relpath(entry.get("path"))
        if problem:
            raise BadInput(f"{where}: {key}: {problem}")
        if entry["path"] in seen:
            raise BadInput(f"{where}: {key}: path '{entry['path']}' is listed twice")
        seen.add(entry["path"])
        try:
            fe = FileEntry(entry["path"], int(entry["size"]), int(entry.get("mtime_ns", 0)), str(entry["hash"]))
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"{where}: {key} ({entry['path']}): bad or missing field ({e})") from None
        if fe.size < 0 or not fe.hash:
            raise BadInput(f"{where}: {key} ({fe.path}): size must be >= 0 and hash non-empty")
        files.append(fe)
    dataset = None
    if "dataset" in doc:
        dataset = _read_dataset(doc["dataset"], where, seen)
    return Manifest(algorithm, files, dataset, doc.get("meta") or {})


def _read_dataset(d: Any, where: str, paths: set[str]) -> TokenDataset:
    if not isinstance(d, dict) or d.get("kind") != "tokens":
        raise BadInput(f"{where}: dataset: only kind 'tokens' is known")
    try:
        shards = [TokenShard(str(s["path"]), int(s["samples"])) for s in d["shards"]]
        ds = TokenDataset(str(d["dtype"]), int(d["vocab_size"]), int(d["sample_len"]), shards)
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: dataset: bad or missing field ({e})") from None
    if ds.dtype not in ("uint8", "uint16", "uint32"):
        raise BadInput(f"{where}: dataset.dtype: '{ds.dtype}' is not uint8, uint16 or uint32")
    for i, s in enumerate(ds.shards):
        if s.path not in paths:
            raise BadInput(f"{where}: dataset.shards[{i}]: '{s.path}' is not in files")
    return ds

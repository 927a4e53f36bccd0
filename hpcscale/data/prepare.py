"""`hpcscale data prepare`: a text corpus to byte-level token shards plus a manifest.

Byte-level tokens (vocabulary 256, uint8) need no tokenizer download. Files are read in sorted order and
joined with a blank line, so the same corpus gives the same shards byte for byte. The output directory
appears atomically (built under a temporary name, then renamed).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np

from hpcscale.data.manifest import MANIFEST_NAME, Manifest, TokenDataset, TokenShard, entry_for, write_manifest
from hpcscale.errors import BadInput

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".yaml", ".yml", ".toml", ".cfg", ".html")


def corpus_files(src: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise BadInput(f"{src}: no such file or directory")
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink() and p.suffix in suffixes)
    if not files:
        raise BadInput(f"{src}: no text files ({', '.join(suffixes)})")
    return files


def prepare(
    src: Path,
    out: Path,
    *,
    sample_len: int = 257,
    shard_samples: int = 4096,
    max_bytes: int | None = None,
    hash_algorithm: str = "xxh128",
) -> Manifest:
    """Write token shards of `shard_samples` samples × `sample_len` bytes and `manifest.json` into `out`."""
    if out.exists():
        raise BadInput(f"{out} exists; choose a new --out (prepared datasets are never overwritten)")
    parts: list[bytes] = []
    total = 0
    for path in corpus_files(src):
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[: max_bytes - total]
        parts.append(data)
        total += len(data) + 2
        if max_bytes is not None and total >= max_bytes:
            break
    tokens = np.frombuffer(b"\n\n".join(parts), dtype=np.uint8)
    n_samples = len(tokens) // sample_len
    if n_samples == 0:
        raise BadInput(f"{src}: corpus has {len(tokens)} bytes, fewer than one sample of {sample_len}")
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "shards").mkdir(parents=True)
    shards = []
    for k, start in enumerate(range(0, n_samples, shard_samples)):
        count = min(shard_samples, n_samples - start)
        rel = f"shards/{k:06d}.bin"
        with open(tmp / rel, "wb") as f:
            f.write(tokens[start * sample_len : (start + count) * sample_len].tobytes())
            f.flush()
            os.fsync(f.fileno())
        shards.append(TokenShard(rel, count))
    files = [entry_for(tmp, s.path, hash_algorithm) for s in shards]
    manifest = Manifest(
        hash_algorithm,
        files,
        TokenDataset("uint8", 256, sample_len, shards),
        {"source": str(src), "tokenizer": "bytes"},
    )
    write_manifest(tmp / MANIFEST_NAME, manifest)
    os.replace(tmp, out)
    return manifest


def default_corpus_dataset(scratch: Path, *, sample_len: int) -> Path:
    """Python's own standard library sources as a dataset (a corpus every machine has), prepared once per
    scratch directory and sample length. Returns the manifest path."""
    out = scratch / "hpcscale-data" / f"pystdlib-{sample_len}"
    manifest = out / MANIFEST_NAME
    if not manifest.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            prepare(Path(sysconfig.get_paths()["stdlib"]), out, sample_len=sample_len, max_bytes=8 << 20)
        except BadInput:
            if not manifest.exists():  # another process won the rename race: its dataset is identical
                raise
    return manifest

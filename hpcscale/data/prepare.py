"""`hpcscale data prepare`: a text corpus to token shards plus a manifest.

By default tokens are bytes (vocabulary 256, uint8): no tokenizer needed. With a Hugging Face `tokenizers`
file (`--tokenizer tokenizer.json`: local, nothing downloaded; the `hf` extra installs the library) each file's
text is encoded by it and the ids are stored as uint16 (uint32 for a vocabulary over 65536); the tokenizer file
is copied into the dataset as `tokenizer.json`, so the manifest hashes it like any shard and the dataset carries
the tokenizer that made it wherever it is staged; `meta` records its hash, the dataset its vocabulary size.

Files are read in sorted order and joined with a blank line (bytes), or encoded one by one and their ids
concatenated (a tokenizer), so the same corpus gives the same shards byte for byte. The output directory
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


TOKENIZER_NAME = "tokenizer.json"


def load_tokenizer(path: Path):
    """A Hugging Face `tokenizers` Tokenizer from a local file; BadInput (exit 2) naming the file when the
    library is missing or the file is not a tokenizer."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise BadInput(
            f"--tokenizer {path}: the tokenizers library is not installed (pip install 'hpcscale[hf]')"
        ) from None
    if not path.is_file():
        raise BadInput(f"--tokenizer {path}: no such file")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own Exception for any unreadable file
        raise BadInput(f"--tokenizer {path}: not a tokenizers file ({str(e)[:200]})") from None


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
    tokenizer: Path | None = None,
    seed: int = 0,
) -> Manifest:
    """Write token shards of `shard_samples` samples × `sample_len` tokens and `manifest.json` into `out`.

    The documents (the corpus's files, read in name order up to `max_bytes`) are written in an order shuffled
    with `seed` (document_order), so that the last samples, which training holds out for validation
    (train.val_fraction), are a seeded sample of whole documents from across the corpus (but the one the
    split cuts), never its last files by name."""
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
    parts = [parts[i] for i in document_order(len(parts), seed)]
    if tokenizer is None:
        tokens = np.frombuffer(b"\n\n".join(parts), dtype=np.uint8)
        vocab, meta = 256, {"source": str(src), "tokenizer": "bytes"}
    else:
        tok = load_tokenizer(tokenizer)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
        encoded = tok.encode_batch([p.decode("utf-8", errors="replace") for p in parts], add_special_tokens=False)
        tokens = np.concatenate([np.asarray(e.ids, dtype=dtype) for e in encoded] or [np.empty(0, dtype)])
        meta = {"source": str(src), "tokenizer": TOKENIZER_NAME}
    meta |= {"documents": len(parts), "document_order": f"shuffled, seed {seed}"}
    n_samples = len(tokens) // sample_len
    if n_samples == 0:
        raise BadInput(f"{src}: corpus has {len(tokens)} tokens, fewer than one sample of {sample_len}")
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "shards").mkdir(parents=True)
    extra = []
    if tokenizer is not None:
        shutil.copyfile(tokenizer, tmp / TOKENIZER_NAME)
        extra.append(entry_for(tmp, TOKENIZER_NAME, hash_algorithm))
        meta["tokenizer_hash"] = extra[0].hash
    shards = []
    for k, start in enumerate(range(0, n_samples, shard_samples)):
        count = min(shard_samples, n_samples - start)
        rel = f"shards/{k:06d}.bin"
        with open(tmp / rel, "wb") as f:
            f.write(tokens[start * sample_len : (start + count) * sample_len].tobytes())
            f.flush()
            os.fsync(f.fileno())
        shards.append(TokenShard(rel, count))
    files = [entry_for(tmp, s.path, hash_algorithm) for s in shards] + extra
    manifest = Manifest(hash_algorithm, files, TokenDataset(tokens.dtype.name, vocab, sample_len, shards), meta)
    write_manifest(tmp / MANIFEST_NAME, manifest)
    os.replace(tmp, out)
    return manifest


def document_order(n: int, seed: int) -> list[int]:
    """The order `prepare` writes `n` documents in: a permutation drawn from numpy's PCG64 seeded with `seed`."""
    return np.random.Generator(np.random.PCG64(seed)).permutation(n).tolist()


def default_corpus_dataset(scratch: Path, *, sample_len: int) -> Path:
    """Python's own standard library sources as a dataset (a corpus every machine has), prepared once per
    scratch directory and sample length. Returns the manifest path."""
    out = scratch / "hpcscale-data" / f"pystdlib-shuffled-{sample_len}"
    manifest = out / MANIFEST_NAME
    if not manifest.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            prepare(Path(sysconfig.get_paths()["stdlib"]), out, sample_len=sample_len, max_bytes=8 << 20)
        except BadInput:
            if not manifest.exists():  # another process won the rename race: its dataset is identical
                raise
    return manifest

"""`hpcscale data prepare`: a text corpus to token shards plus a manifest.

By default tokens are bytes (vocabulary 256, uint8): no tokenizer needed. With a Hugging Face `tokenizers`
file (`--tokenizer tokenizer.json`: local, nothing downloaded; the `hf` extra installs the library) each file's
text is encoded by it; the dataset's vocabulary size is the tokenizer's largest id + 1 (hpcscale.data.corpus),
and the ids are stored as uint16, or uint32 when an id is over 65535 (the manifest's `dataset.dtype` says
which). The tokenizer file is read once and those bytes are copied into the dataset as `tokenizer.json`, so
the manifest hashes the tokenizer that made the ids like any shard and the dataset carries it wherever it is
staged; `meta` records its hash.

Files are read in sorted order and joined with a blank line (bytes), or encoded one by one and their ids
concatenated (a tokenizer), so the same corpus gives the same shards byte for byte. Memory is bounded whatever
the corpus's size: text is read, encoded and written as it streams (hpcscale.data.corpus), and a shard is
written as its tokens come.

The output directory appears whole or not at all, and nothing is written through a name someone else could
have planted: it is built in a fresh private directory beside it and renamed into place without replacing
anything (hpcscale.data.builddir). A name that exists (a directory, a file, a symbolic link, dangling or not)
is refused with exit 2 and left as it is.
"""

from __future__ import annotations

import os
import stat
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hpcscale.data import corpus
from hpcscale.data.builddir import BuildDir
from hpcscale.data.corpus import TEXT_SUFFIXES, corpus_files, load_tokenizer  # noqa: F401  (re-exported)
from hpcscale.data.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    TokenDataset,
    TokenShard,
    hasher,
    manifest_text,
)
from hpcscale.errors import BadInput
from hpcscale.portable import hashing, paths
from hpcscale.portable.files import atomic_create, atomic_write
from hpcscale.util import trust

TOKENIZER_NAME = "tokenizer.json"


class ShardWriter:
    """Token shards of `shard_samples` samples x `sample_len` tokens, written into `shards/` of a BuildDir as
    the tokens come: only whole samples are written (what is left at the end, less than one sample, is not),
    each shard hashed as it is written and fsync'd when full. Memory: less than one sample held back."""

    def __init__(self, build: BuildDir, *, dtype: np.dtype, sample_len: int, shard_samples: int, algorithm: str):
        self.build, self.dtype, self.algorithm = build, np.dtype(dtype), algorithm
        self.sample_len, self.shard_samples = sample_len, shard_samples
        self.dir_fd = build.mkdir("shards")
        self.carry = np.empty(0, self.dtype)  # tokens short of a whole sample
        self.tokens = 0  # seen, all told
        self.shards: list[TokenShard] = []
        self.entries: list[FileEntry] = []
        self._fd: int | None = None
        self._hash = None
        self._samples = 0  # in the open shard

    def add(self, ids: np.ndarray) -> None:
        self.tokens += len(ids)
        data = np.concatenate([self.carry, ids.astype(self.dtype, copy=False)]) if len(self.carry) else ids
        whole = len(data) // self.sample_len
        self.carry = np.array(data[whole * self.sample_len :], dtype=self.dtype)
        samples = np.asarray(data[: whole * self.sample_len], dtype=self.dtype).reshape(whole, self.sample_len)
        while len(samples):
            if self._fd is None:
                self._open()
            take = samples[: self.shard_samples - self._samples]
            self._write(take)
            samples = samples[len(take) :]
            if self._samples == self.shard_samples:
                self._close()

    def finish(self) -> None:
        if self._fd is not None:
            self._close()

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards) + self._samples

    def _open(self) -> None:
        self.rel = f"shards/{len(self.shards):06d}.bin"
        self._fd = BuildDir.create(self.rel.split("/")[1], dir_fd=self.dir_fd)
        self._hash = hashing.hasher(self.algorithm)
        self._samples = 0

    def _write(self, samples: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(samples)).cast("B")
        self._hash.update(view)
        while view:
            view = view[os.write(self._fd, view) :]
        self._samples += len(samples)

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self.shards.append(TokenShard(self.rel, self._samples))
        entry = FileEntry(self.rel, st.st_size, st.st_mtime_ns, self._hash.hexdigest(), st.st_mode & paths.MODE_BITS)
        self.entries.append(entry)
        self._samples = 0


def _write_file(build: BuildDir, name: str, data: bytes, algorithm: str) -> FileEntry:
    """`name` in the build directory holding `data`, whole or not at all (atomic_create: a kill or a full disk
    mid-write leaves no part of it under its name), mode 0666 less the umask as a shard's."""
    if not atomic_create(name, data, dir_fd=build.fd, mode=0o666):
        raise BadInput(f"{build.out}: {name} already exists in the directory being built")
    st = os.stat(name, dir_fd=build.fd, follow_symlinks=False)
    h = hashing.hasher(algorithm)
    h.update(data)
    return FileEntry(name, st.st_size, st.st_mtime_ns, h.hexdigest(), st.st_mode & paths.MODE_BITS)


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
    out = Path(out)
    if os.path.lexists(out):
        raise BadInput(f"{out} exists; choose a new --out (prepared datasets are never overwritten)")
    if sample_len < 1 or shard_samples < 1:
        raise BadInput(f"sample length {sample_len} and samples per shard {shard_samples} must be at least 1")
    hasher(hash_algorithm)  # an unknown algorithm: BadInput before any work
    loaded = load_tokenizer(tokenizer) if tokenizer is not None else None
    docs = corpus.documents(src, max_bytes)
    docs = [docs[i] for i in document_order(len(docs), seed)]
    if loaded is None:
        tokens: Iterator[np.ndarray] = corpus.byte_tokens(docs)
        dtype, vocab, meta = np.dtype(np.uint8), 256, {"source": str(src), "tokenizer": "bytes"}
    else:
        tokens = corpus.tokenizer_ids(loaded, docs, name=tokenizer)
        dtype, vocab = corpus.token_dtype(loaded.vocab_size), loaded.vocab_size
        meta = {"source": str(src), "tokenizer": TOKENIZER_NAME}
    meta |= {"documents": len(docs), "document_order": f"shuffled, seed {seed}"}
    out.parent.mkdir(parents=True, exist_ok=True)
    with BuildDir(out) as build:
        extra = []
        if loaded is not None:
            extra.append(_write_file(build, TOKENIZER_NAME, loaded.text, hash_algorithm))
            meta["tokenizer_hash"] = extra[0].hash
        writer = ShardWriter(
            build, dtype=dtype, sample_len=sample_len, shard_samples=shard_samples, algorithm=hash_algorithm
        )
        for ids in tokens:
            writer.add(ids)
        writer.finish()
        if writer.samples == 0:
            raise BadInput(f"{src}: corpus has {writer.tokens} tokens, fewer than one sample of {sample_len}")
        dataset = TokenDataset(dtype.name, vocab, sample_len, writer.shards)
        manifest = Manifest(hash_algorithm, writer.entries + extra, dataset, meta)
        atomic_write(MANIFEST_NAME, manifest_text(manifest), dir_fd=build.fd)
        build.commit()
    return manifest


def document_order(n: int, seed: int) -> list[int]:
    """The order `prepare` writes `n` documents in: a permutation drawn from numpy's PCG64 seeded with `seed`."""
    return np.random.Generator(np.random.PCG64(seed)).permutation(n).tolist()


def default_corpus_dataset(scratch: Path, *, sample_len: int) -> Path:
    """Python's own standard library sources as a dataset (a corpus every machine has), prepared once per
    scratch directory and sample length. Returns the manifest path. A scratch directory may be shared: the
    dataset found there is used only when `hpcscale-data`, the dataset's directory and its manifest are
    yours (or root's) and none is a symbolic link; otherwise BadInput (exit 2) naming what is not."""
    home = scratch / "hpcscale-data"
    out = home / f"pystdlib-shuffled-{sample_len}"
    manifest = out / MANIFEST_NAME
    home.mkdir(parents=True, exist_ok=True)
    _refuse_unless_ours(home)
    if not os.path.lexists(out):
        try:
            prepare(Path(sysconfig.get_paths()["stdlib"]), out, sample_len=sample_len, max_bytes=8 << 20)
        except BadInput:
            if not os.path.lexists(manifest):  # another process won the rename race: its dataset is identical
                raise
    _refuse_unless_ours(out)
    _refuse_unless_ours(manifest)
    return manifest


def _refuse_unless_ours(path: Path) -> None:
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "a symbolic link"
    elif st.st_uid not in trust.trusted_owners():
        why = trust.problem(st, directory=stat.S_ISDIR(st.st_mode))
    if why:
        raise BadInput(
            f"{path}: refusing the default dataset: {why}; someone else may have put it there. Remove it, or "
            "name a dataset of yours with data.manifest"
        )

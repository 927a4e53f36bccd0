"""The corpus side of `data prepare`: which files, in which order, and their tokens, in bounded memory.

Memory does not grow with the corpus. Files are read in blocks of READ_BYTES. A tokenizer sees the text in
pieces of at most PIECE_BYTES, cut at a line end (a line longer than that at a space, else at a character
boundary), and encodes batches of pieces holding about BATCH_BYTES of text at a time: the library's Encodings
(ids, offsets, token strings: about 130-220 bytes of memory per byte of text) exist for one batch only, and
only their ids are kept, until they are written. A file no longer than PIECE_BYTES is encoded whole, exactly
as `tokenizer.encode(text)` would; a longer one piece by piece, which can tokenize differently at a cut where
the tokenizer would have made one token across a line end.

A tokenizer's vocabulary size is its largest id + 1, over its whole vocabulary, added tokens included (a
vocabulary may have gaps: `get_vocab_size` counts entries, not ids), and every id it produces is checked
against it before it is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcscale.errors import BadInput
from hpcscale.portable.files import NotRegularFile, open_regular, read_regular

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".yaml", ".yml", ".toml", ".cfg", ".html")
READ_BYTES = 1 << 20
PIECE_BYTES = 256 << 10
BATCH_BYTES = 1 << 20
MAX_TOKENIZER_BYTES = 1 << 30  # the largest tokenizer.json files published are tens of MB
MAX_VOCAB = 1 << 32  # uint32 token shards


@dataclass(frozen=True, slots=True)
class Document:
    """One file of the corpus and how much of it is read (None: all; less where --max-mb cuts it)."""

    path: Path
    limit: int | None


@dataclass(frozen=True, slots=True)
class LoadedTokenizer:
    tokenizer: Any  # tokenizers.Tokenizer
    text: bytes  # the file's bytes: what was loaded is what the dataset carries
    vocab_size: int  # largest id + 1


def corpus_files(src: Path, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise BadInput(f"{src}: no such file or directory")
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink() and p.suffix in suffixes)
    if not files:
        raise BadInput(f"{src}: no text files ({', '.join(suffixes)})")
    return files


def documents(src: Path, max_bytes: int | None) -> list[Document]:
    """The corpus's files in name order, up to `max_bytes` of text (each file counts 2 more: the blank line
    that joins byte-level documents)."""
    out: list[Document] = []
    total = 0
    for path in corpus_files(src):
        if max_bytes is None:
            out.append(Document(path, None))
            continue
        size = path.stat().st_size
        take = min(size, max_bytes - total)
        out.append(Document(path, take))
        total += take + 2
        if total >= max_bytes:
            break
    return out


def blocks(doc: Document) -> Iterator[bytes]:
    """The document's bytes, READ_BYTES at a time, at most `doc.limit` of them."""
    left = doc.limit
    try:
        fd, _ = open_regular(doc.path)  # a FIFO swapped in since the listing is refused, never waited on
    except OSError as e:
        raise BadInput(f"{doc.path}: cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        while left is None or left > 0:
            block = f.read(READ_BYTES if left is None else min(READ_BYTES, left))
            if not block:
                return
            if left is not None:
                left -= len(block)
            yield block


def _cut(buf: bytearray, size: int) -> int:
    """Where to end a piece of `buf` (longer than `size`): after its last line end within `size`, else before
    its last space or tab, else at the last character boundary (never inside a UTF-8 sequence)."""
    line = buf.rfind(b"\n", 0, size)
    if line >= 0:
        return line + 1
    space = max(buf.rfind(b" ", 0, size), buf.rfind(b"\t", 0, size))
    if space > 0:
        return space
    k = size
    while k > 0 and 0x80 <= buf[k] < 0xC0:  # a continuation byte: the character started before k
        k -= 1
    return k or size


def pieces(chunks: Iterator[bytes], size: int = PIECE_BYTES) -> Iterator[bytes]:
    """The concatenated `chunks` again, as pieces of at most `size` bytes cut where `_cut` says."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        while len(buf) > size:
            cut = _cut(buf, size)
            yield bytes(buf[:cut])
            del buf[:cut]
    if buf:
        yield bytes(buf)


def byte_tokens(docs: list[Document]) -> Iterator[np.ndarray]:
    """Byte-level tokens (uint8): the documents' bytes, joined by a blank line."""
    for i, doc in enumerate(docs):
        if i:
            yield np.frombuffer(b"\n\n", dtype=np.uint8)
        for block in blocks(doc):
            yield np.frombuffer(block, dtype=np.uint8)


def load_tokenizer(path: Path) -> LoadedTokenizer:
    """A Hugging Face `tokenizers` Tokenizer from a local file, read once; BadInput (exit 2) naming the file
    when the library is missing, the file is not a tokenizer, or its vocabulary is empty or over 2^32 ids."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise BadInput(
            f"--tokenizer {path}: the tokenizers library is not installed (pip install 'hpcscale[hf]')"
        ) from None
    try:
        text, _ = read_regular(path, max_bytes=MAX_TOKENIZER_BYTES)
    except FileNotFoundError:
        raise BadInput(f"--tokenizer {path}: no such file") from None
    except (NotRegularFile, OSError) as e:
        raise BadInput(f"--tokenizer {path}: cannot be read ({e.strerror or e})") from None
    try:
        tok = Tokenizer.from_str(text.decode("utf-8"))
    except Exception as e:  # the library raises its own Exception for any unreadable file
        raise BadInput(f"--tokenizer {path}: not a tokenizers file ({str(e)[:200]})") from None
    ids = tok.get_vocab(with_added_tokens=True).values()
    if not ids:
        raise BadInput(f"--tokenizer {path}: its vocabulary is empty")
    vocab = max(ids) + 1
    if vocab > MAX_VOCAB:
        raise BadInput(f"--tokenizer {path}: its largest id is {vocab - 1}; token shards hold ids below 2^32")
    return LoadedTokenizer(tok, text, vocab)


def token_dtype(vocab_size: int) -> np.dtype:
    """What a tokenizer's ids are stored as: uint16 while they fit, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenizer_ids(loaded: LoadedTokenizer, docs: list[Document], *, name: Path) -> Iterator[np.ndarray]:
    """The tokenizer's ids of each document's text (no special tokens added), document after document, in
    batches of about BATCH_BYTES of text; an id at or past the vocabulary size is BadInput naming `name`."""
    tok = loaded.tokenizer
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # _fast: no offsets (tokenizers 0.20+)

    def encoded(batch: list[str]) -> Iterator[np.ndarray]:
        for e in encode(batch, add_special_tokens=False):
            ids = np.asarray(e.ids, dtype=np.int64)
            if ids.size and int(ids.max()) >= loaded.vocab_size:
                raise BadInput(
                    f"--tokenizer {name}: it produced id {int(ids.max())}, which is not in its vocabulary "
                    f"(largest id {loaded.vocab_size - 1})"
                )
            yield ids

    batch: list[str] = []
    held = 0
    for doc in docs:
        for piece in pieces(blocks(doc)):
            batch.append(piece.decode("utf-8", errors="replace"))
            held += len(piece)
            if held >= BATCH_BYTES:
                yield from encoded(batch)
                batch, held = [], 0
    if batch:
        yield from encoded(batch)

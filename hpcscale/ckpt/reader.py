"""Loading: each rank reads only the chunks that overlap its own pieces, checks every chunk's hash, and
copies the overlap into place; the saved layout and the loading layout may differ (resharding)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

from hpcscale.ckpt.format import ChunkRef, Index, ShardRecord, TensorView, open_data_file, tensor_view
from hpcscale.ckpt.integrity import DTYPE_SIZES
from hpcscale.ckpt.shards import LocalShard
from hpcscale.errors import VerificationFailure

RUN_BYTES = 16 << 20  # adjacent chunks read with one preadv, up to about this many bytes...
RUN_CHUNKS = 500  # ...and this many chunks (with a gap's buffer between each two: below IOV_MAX, 1024 on Linux)
GAP_BYTES = 4096  # a run reads through a gap this long at most: a chunk's padding (under writer.ALIGN), no chunk
PIECE_BYTES = 16 << 20  # a chunk needed only in part (fill_box) is read and hashed in pieces this long at most


class ChunkReader:
    """Reads and verifies chunks, keeping files open across a load."""

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        self._gap: memoryview | None = None  # where a run's gaps are read to: one buffer, reused
        self._piece: memoryview | None = None  # where read_part reads: one buffer of PIECE_BYTES, reused

    def _fd(self, tensor: str, ref) -> int:
        fd = self._fds.get(ref.file)
        if fd is None:
            try:
                fd = open_data_file(self.root / ref.file)  # never a symlink, never blocking on a FIFO
            except FileNotFoundError:
                raise VerificationFailure(
                    f"tensor {tensor}: chunk {ref.hash} is in {ref.file}, which is missing"
                ) from None
            except OSError as e:
                raise VerificationFailure(f"tensor {tensor}: cannot open {ref.file}: {e.strerror}") from None
            self._fds[ref.file] = fd
        return fd

    def read(self, tensor: str, ref, out: memoryview) -> None:
        self.read_run([(tensor, ref, out)])

    def advise(self, tensor: str, ref, length: int) -> None:
        """Ask the kernel to start reading `length` bytes at `ref` (POSIX_FADV_WILLNEED) and return at once."""
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(self._fd(tensor, ref), ref.offset, length, os.POSIX_FADV_WILLNEED)

    def read_run(self, run: list[tuple[str, ChunkRef, memoryview]]) -> None:
        """Read chunks that follow one another in one file, in file order, with one preadv, then verify each.

        Small tensors make small chunks; one read per chunk left a cold load at about half the speed of a plain
        sequential read of the same bytes (the device saw requests of a chunk's size), so runs of adjacent
        chunks are read together, up to RUN_BYTES at a time. The gaps between them (the zero padding that ends
        a chunk whose length is not a multiple of ALIGN in an O_DIRECT data file, at most GAP_BYTES) are read
        into a scratch buffer and ignored: without that every 2 KiB bias or norm weight ended a run."""
        tensor, first, _ = run[0]
        fd = self._fd(tensor, first)
        bufs: list[memoryview] = []
        end = first.offset
        for _, ref, out in run:
            gap = ref.offset - end
            if gap:
                if not 0 < gap <= GAP_BYTES:
                    raise ValueError(f"chunks at {end} and {ref.offset} in {ref.file} are not one run")
                if self._gap is None:
                    self._gap = memoryview(bytearray(GAP_BYTES))
                bufs.append(self._gap[:gap])
            bufs.append(out)
            end = ref.offset + ref.length
        got = os.preadv(fd, bufs, first.offset)
        self.bytes_read += got
        for tensor, ref, out in run:
            have = max(0, min(ref.length, got - (ref.offset - first.offset)))
            if have != ref.length:
                raise VerificationFailure(
                    f"tensor {tensor}: chunk {ref.hash} in {ref.file} at {ref.offset}: "
                    f"file truncated ({have} of {ref.length} bytes)"
                )
            if xxhash.xxh3_128_hexdigest(out) != ref.hash:
                raise VerificationFailure(
                    f"tensor {tensor}: chunk {ref.hash} in {ref.file} at {ref.offset}: hash mismatch (corrupt data)"
                )

    def read_part(self, tensor: str, ref: ChunkRef, lo: int, hi: int, put: Callable[[int, memoryview], None]) -> None:
        """Read chunk `ref` whole, PIECE_BYTES at a time, hashing every byte, and hand its bytes [lo, hi) to
        `put(position from lo, bytes)` as they pass. Memory: one piece, whatever the chunk's length. Raises
        VerificationFailure when the chunk is short or its hash differs, after `put` has seen bytes of it: the
        caller discards what it put (an export removes its unfinished file)."""
        fd = self._fd(tensor, ref)
        if self._piece is None:
            self._piece = memoryview(bytearray(PIECE_BYTES))
        h = xxhash.xxh3_128()
        pos = 0
        while pos < ref.length:
            view = self._piece[: min(PIECE_BYTES, ref.length - pos)]
            got = os.preadv(fd, [view], ref.offset + pos)
            if got == 0:
                break
            h.update(view[:got])
            a, b = max(lo, pos), min(hi, pos + got)
            if a < b:
                put(a - lo, view[a - pos : b - pos])
            pos += got
        self.bytes_read += pos
        if pos != ref.length:
            raise VerificationFailure(
                f"tensor {tensor}: chunk {ref.hash} in {ref.file} at {ref.offset}: file truncated "
                f"({pos} of {ref.length} bytes)"
            )
        if h.hexdigest() != ref.hash:
            raise VerificationFailure(
                f"tensor {tensor}: chunk {ref.hash} in {ref.file} at {ref.offset}: hash mismatch (corrupt data)"
            )

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or dt.itemsize != DTYPE_SIZES.get(name):
        raise VerificationFailure(f"unknown dtype '{name}' in the index")
    return dt


def _overlap(a_off, a_shape, b_off, b_shape):
    lo = [max(x, y) for x, y in zip(a_off, b_off, strict=True)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape, strict=True)]
    return (lo, hi) if all(h > low for low, h in zip(lo, hi, strict=True)) else None


def _byte_span(shard: ShardRecord, elt: int, lo, hi) -> tuple[int, int]:
    """[start, end) of the shard's bytes (row-major) that hold the global box [lo, hi)."""
    if not shard.shape:
        return 0, elt
    local_lo = [x - o for x, o in zip(lo, shard.offset, strict=True)]
    local_hi = [x - o for x, o in zip(hi, shard.offset, strict=True)]
    first = int(np.ravel_multi_index(local_lo, shard.shape))
    last = int(np.ravel_multi_index([h - 1 for h in local_hi], shard.shape))
    return first * elt, (last + 1) * elt


def _chunks_in(shard: ShardRecord, span: tuple[int, int]):
    """(position in the shard, chunk) of the chunks that hold any byte of `span`."""
    pos = 0
    for ref in shard.chunks:
        if pos < span[1] and pos + ref.length > span[0]:
            yield pos, ref
        pos += ref.length


def _shard_bytes(name: str, shard: ShardRecord, elt: int) -> int:
    """The saved shard's size in bytes, checked against the lengths of its chunks."""
    nbytes = int(np.prod(shard.shape)) * elt if shard.shape else elt
    have = sum(ref.length for ref in shard.chunks)
    if have != nbytes:
        raise VerificationFailure(
            f"tensor {name}: shard at {shard.offset} has {have} bytes of chunks for {nbytes} bytes of data"
        )
    return nbytes


def _region(name: str, shard: ShardRecord, dtype: torch.dtype, lo, hi):
    """For the global box [lo, hi) of a saved shard: a buffer for the shard's bytes, the (position, chunk) pairs
    that hold the box, and the box's view of the buffer, valid once those chunks are read into it."""
    elt = dtype.itemsize
    buf = np.empty(_shard_bytes(name, shard, elt), dtype=np.uint8)
    needed = list(_chunks_in(shard, _byte_span(shard, elt, lo, hi)))
    full = (
        torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shard.shape)
        if buf.size
        else torch.empty(shard.shape, dtype=dtype)
    )
    return buf, needed, full[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, shard.offset, strict=True))]


def _ravel(index, shape) -> int:
    """Row-major position of `index` in `shape` (0 for a scalar)."""
    at = 0
    for x, n in zip(index, shape, strict=True):
        at = at * n + x
    return at


def _put(dest: np.ndarray, at: int, data: memoryview) -> None:
    """Write `data` into `dest`'s bytes [at, at + len(data)) in row-major order, `dest` being a (strided) uint8
    view: a partial first row, whole rows in one assignment, a partial last row, each dimension down."""
    src = np.frombuffer(data, dtype=np.uint8)
    if dest.ndim == 1:
        dest[at : at + src.size] = src
        return
    row = math.prod(dest.shape[1:])
    first, skip = divmod(at, row)
    done = 0
    if skip:
        take = min(row - skip, src.size)
        _put(dest[first], skip, data[:take])
        done, first = take, first + 1
    whole = (src.size - done) // row
    if whole:
        dest[first : first + whole] = src[done : done + whole * row].reshape((whole, *dest.shape[1:]))
        done, first = done + whole * row, first + whole
    if done < src.size:
        _put(dest[first], 0, data[done:])


def fill_box(reader: ChunkReader, view: TensorView, chunk_bytes: int, lo, hi, out: np.ndarray) -> None:
    """Fill `out` with the elements of `view`'s tensor in the global box [lo, hi) from every saved shard that
    overlaps it. `out` is uint8 of shape (hi - lo) + (element size,); the box must be one whose overlap with any
    shard is contiguous in that shard (the whole tensor, or a block from hpcscale.ckpt.export: one index along
    the leading dimensions, a range along one, the whole extent after it). Only chunks holding bytes of the box
    are read, each whole and hashed a piece at a time (ChunkReader.read_part), so memory is `out` and one piece.
    VerificationFailure on a bad chunk, or when the shards do not cover the box (read_index proved the tiling;
    counted again here because an element no shard writes would go out as whatever `out` held)."""
    if out.size == 0:
        return
    elt = out.shape[-1]
    box_lo, box_hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    start_of = np.maximum(view.offsets, box_lo)
    end_of = np.minimum(view.offsets + view.shapes, box_hi)
    covered = 0
    for j in (start_of < end_of).all(axis=1).nonzero()[0].tolist():
        a, b = start_of[j].tolist(), end_of[j].tolist()
        offset, shape = view.offsets[j].tolist(), view.shapes[j].tolist()
        count = math.prod(y - x for x, y in zip(a, b, strict=True)) * elt
        first = _ravel([x - o for x, o in zip(a, offset, strict=True)], shape) * elt
        last = (_ravel([y - 1 - o for y, o in zip(b, offset, strict=True)], shape) + 1) * elt
        if last - first != count:
            raise ValueError(f"box {lo}..{hi} is not contiguous in shard {offset} {shape} of {view.name}")
        dest = out[tuple(slice(x - low, y - low) for x, y, low in zip(a, b, lo, strict=True))]
        c0, c1 = first // chunk_bytes, (first + count - 1) // chunk_bytes + 1  # every chunk but a shard's last is full
        for k, ref in enumerate(view.chunks(j, c0, c1), start=c0):
            pos = k * chunk_bytes  # the chunk's place in the shard's bytes
            lo_b, hi_b = max(first, pos), min(first + count, pos + ref.length)

            def put(at: int, data: memoryview, dest=dest, base=lo_b - first) -> None:
                _put(dest, base + at, data)

            reader.read_part(view.name, ref, lo_b - pos, hi_b - pos, put)
        covered += count
    if covered != out.size:
        raise VerificationFailure(
            f"tensor {view.name}: its shards cover {covered // elt} of the {out.size // elt} elements "
            f"from {list(lo)} to {list(hi)}"
        )


def overlapping(view: TensorView, t: LocalShard) -> list:
    """The saved shards of `view` that overlap target piece `t`, in the index's order. One vectorised test over
    all of them (a tensor of a 4096-rank checkpoint has thousands of shards; a Python test per shard and target
    made planning a load quadratic in the ranks), and only the overlapping shards' records are built."""
    if t.tensor.numel() == 0:
        return []
    if not t.global_shape:
        return [view.shard(j) for j in range(len(view))]
    off = view.offsets
    end = off + view.shapes
    lo = np.asarray(t.offset, dtype=np.int64)
    hi = lo + np.asarray(t.tensor.shape, dtype=np.int64)
    hit = ((np.maximum(off, lo) < np.minimum(end, hi)).all(axis=1)).nonzero()[0]
    return [view.shard(j) for j in hit.tolist()]


def plan_reads(index: Index, targets: list[LocalShard]) -> tuple[list, list, list]:
    """What load_shards reads for `targets`, without reading: (reads, extra, partial). `reads` are the distinct
    chunks in file order, each (tensor, chunk, destination, index into `partial` or -1); `extra[n]` the other
    destinations of reads[n] (a chunk several pieces hold); `partial` the shard buffers a partly needed shard
    is read into, with their destination. VerificationFailure when the checkpoint does not cover a target."""
    reads: list = []  # (tensor, chunk, destination, index into `partial` or -1); None once read
    partial: list[list | None] = []  # [destination, region of a shard buffer, chunks still to read]
    views: dict[str, TensorView | None] = {}
    for t in targets:
        rec = views[t.name] = views[t.name] if t.name in views else tensor_view(index, t.name)
        if rec is None:
            raise VerificationFailure(f"the checkpoint has no tensor {t.name}")
        if tuple(rec.global_shape) != tuple(t.global_shape):
            raise VerificationFailure(
                f"tensor {t.name}: saved with shape {rec.global_shape}, the model has {t.global_shape}"
            )
        dtype = torch_dtype(rec.dtype)
        covered = 0
        for shard in overlapping(rec, t):
            lo, hi = _overlap(shard.offset, shard.shape, t.offset, tuple(t.tensor.shape))
            dest = t.tensor[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, t.offset, strict=True))]
            whole = list(lo) == list(shard.offset) and tuple(h - a for a, h in zip(lo, hi, strict=True)) == shard.shape
            if whole and dest.is_contiguous() and dest.dtype == dtype and dest.device.type == "cpu":
                _shard_bytes(t.name, shard, dtype.itemsize)
                out = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
                pos = 0
                for ref in shard.chunks:
                    reads.append((t.name, ref, out[pos : pos + ref.length], -1))
                    pos += ref.length
                covered += dest.numel()
                continue
            buf, needed, region = _region(t.name, shard, dtype, lo, hi)
            for at, ref in needed:
                reads.append((t.name, ref, memoryview(buf[at : at + ref.length]), len(partial)))
            partial.append([dest, region, len(needed)])
            covered += region.numel()
        if covered != t.tensor.numel():
            raise VerificationFailure(
                f"tensor {t.name}: the checkpoint covers {covered} of the {t.tensor.numel()} elements this rank needs"
            )
    reads.sort(key=lambda r: (r[1].file, r[1].offset))
    # A chunk that several pieces hold (identical content: a checkpoint stores it once) is read once and copied
    # to the others once verified. `extra[n]` lists the other destinations of reads[n], with their pieces.
    unique: list[tuple[str, ChunkRef, memoryview, int]] = []
    extra: list[list[tuple[memoryview, int]]] = []
    for r in reads:
        if unique and unique[-1][1] == r[1]:
            extra[-1].append((r[2], r[3]))
        else:
            unique.append(r)
            extra.append([])
    reads = unique
    return reads, extra, partial


def load_shards(index: Index, root: Path, targets: list[LocalShard]) -> int:
    """Fill each target piece from the checkpoint; returns bytes read. VerificationFailure on any problem.

    First every chunk this rank needs is listed with where its bytes go (straight into the destination when a
    saved shard lands whole in one contiguous run of it, else into a buffer of that shard); then the chunks are
    read in file order, each file front to back as a plain sequential read would go, chunks that follow one
    another (across a chunk's padding) in one preadv (ChunkReader.read_run), and only the next run announced
    with POSIX_FADV_WILLNEED while this one is verified (asking for all of them ahead was measured slower). A
    chunk several pieces hold is read once. A partly needed shard is copied into place, and its buffer dropped,
    as soon as its last chunk is in."""
    reads, extra, partial = plan_reads(index, targets)
    reader = ChunkReader(root)
    try:
        runs: list[tuple[int, int, int]] = []  # [i, j, bytes from the first chunk's start to the last's end)
        i = 0
        while i < len(reads):
            j, size = i + 1, reads[i][1].length
            while j < len(reads) and j - i < RUN_CHUNKS and size < RUN_BYTES:
                prev, ref = reads[j - 1][1], reads[j][1]
                gap = ref.offset - (prev.offset + prev.length)
                if ref.file != prev.file or not 0 <= gap <= GAP_BYTES:
                    break
                size += gap + ref.length
                j += 1
            runs.append((i, j, size))
            i = j

        def done(k: int) -> None:
            if k >= 0:
                piece = partial[k]
                piece[2] -= 1
                if piece[2] == 0:
                    with torch.no_grad():
                        piece[0].copy_(piece[1].to(piece[0].dtype))
                    partial[k] = None  # the shard's buffer goes with it

        for n, (i, j, _) in enumerate(runs):
            if n + 1 < len(runs):  # the device reads the next run while this one is hashed and copied
                a, _, size = runs[n + 1]
                reader.advise(reads[a][0], reads[a][1], size)
            run = reads[i:j]
            reads[i:j] = [None] * (j - i)  # a read done holds no shard buffer any longer
            reader.read_run([(name, ref, out) for name, ref, out, _ in run])
            for m, (_, _, out, k) in enumerate(run, start=i):
                done(k)
                for dest, k2 in extra[m]:
                    dest[:] = out
                    done(k2)
                extra[m] = []
        return reader.bytes_read
    finally:
        reader.close()

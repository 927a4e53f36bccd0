"""Saving one checkpoint: snapshot, chunk, hash, write new chunks, fsync, gather tables, commit.

Commit order (the atomicity argument):
1. every rank writes its new chunks into `.tmp-step-N/data/rank-R.bin` and fsyncs file and directory;
2. each rank sends its chunk table to rank 0 over the checkpoint's own gloo group (never the training
   group, so a background save cannot interleave with training collectives);
3. rank 0 writes `index.h5.tmp` and `DIGEST` (its root digest), fsyncs both, renames `index.h5.tmp` to
   `index.h5`, fsyncs the directory, renames `.tmp-step-N` to `step-N`, fsyncs the root, then replaces
   `LATEST`;
4. rank 0 applies retention and tells every rank the outcome (and which files retention removed).
A crash before (3) leaves only a `.tmp-*` directory (cleaned at the next start); a checkpoint directory
without `index.h5` is never considered complete.

Fault injection for tests: HPCSCALE_CKPT_FAULT=<point>[@<rank>] kills the process with SIGKILL at one of
`data_written` (every chunk queued, some maybe not yet written; before fsync), `data_durable` (before sending
tables), `index_written` (before the renames), `gc` (between deleting files).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from hpcscale.ckpt.faults import fault
from hpcscale.ckpt.format import (
    CHUNK_BYTES,
    INDEX,
    LATEST,
    ChunkRef,
    Index,
    Rows,
    index_of_rows,
    rows_of,
    step_dir_name,
    write_digest_file,
    write_index,
)
from hpcscale.ckpt.integrity import DTYPE_SIZES
from hpcscale.ckpt.rng import rng_state  # noqa: F401 - re-exported: tests build indexes with it
from hpcscale.ckpt.shards import LocalShard
from hpcscale.portable.files import atomic_write, fsync_dir

ALIGN = 4096  # O_DIRECT's alignment for memory, file offsets and lengths (every device's logical block divides it)


HUGE = 2 << 20  # a transparent huge page


def aligned_size(n: int) -> int:
    """n rounded up to a multiple of ALIGN: the room a chunk of n bytes takes in an O_DIRECT data file."""
    return -(-n // ALIGN) * ALIGN


def arena(nbytes: int, *, huge: bool = True) -> torch.Tensor:
    """`nbytes` of fresh anonymous memory as a flat uint8 tensor that starts on a huge-page boundary, with `huge`
    advised to use transparent huge pages. O_DIRECT then pins its pages 512 at a time (far less kernel time per
    write than from 4 KiB pages), and copies into it miss the TLB less; the price is paid once,
    when the pages are first touched (the kernel may have to compact memory to find 2 MiB pieces)."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # EINVAL from kernels built without transparent huge pages
            m.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # holds a reference to the mapping
    skip = -raw.data_ptr() % HUGE
    return raw[skip : skip + nbytes]


def aligned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in its own arena, so O_DIRECT can write straight from it."""
    return arena(shape.numel() * dtype.itemsize).view(dtype).view(shape)


def _carve(shards: list[LocalShard], whole: torch.Tensor) -> list[torch.Tensor]:
    """Buffers shaped like the shards' tensors, cut from `whole` (staging_bytes(shards) of it), each starting on
    an ALIGN boundary."""
    out, pos = [], 0
    for s in shards:
        n = s.tensor.numel() * s.tensor.dtype.itemsize
        out.append(whole[pos : pos + n].view(s.tensor.dtype).view(s.tensor.shape))
        pos += aligned_size(n)
    return out


def staging_bytes(shards: list[LocalShard]) -> int:
    """The bytes of one arena that holds a buffer for each shard, each rounded up to ALIGN."""
    return sum(aligned_size(s.tensor.numel() * s.tensor.dtype.itemsize) for s in shards)


def _key(s: LocalShard) -> str:
    return f"{s.name}@{s.offset}"


def _cudart_clear_error() -> None:
    """Reset the CUDA runtime's last error on this thread after a failed cudaHostRegister/Unregister: torch checks
    cudaGetLastError after its kernel launches, and would report ours at an unrelated one. Only a libcudart
    already loaded (by torch) is asked; none found, nothing is done."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _pin(memory: torch.Tensor) -> str | None:
    """Page-lock `memory` (a CPU tensor's bytes) where it lies, for the GPU's copy engines: cudaHostRegister of
    exactly its bytes (torch.cuda.cudart(), as torch.distributed.checkpoint's own staging does). None when done,
    else why not."""
    cudart = torch.cuda.cudart()
    # cudaHostRegisterPortable (1): pinned for every device's context, not only the current one's
    code = int(cudart.cudaHostRegister(memory.data_ptr(), memory.numel() * memory.element_size(), 1))
    if code == 0:
        return None
    _cudart_clear_error()
    return f"cudaHostRegister: {cudart.cudaGetErrorString(cudart.cudaError(code))} ({code})"


def _unpin(ptr: int) -> None:
    """cudaHostUnregister(ptr), for _Arena's finalizer: the memory is still mapped (the arena's tensor lives on
    until its finalizer has run). A failure has nothing to undo (the pages stay locked until the mapping goes),
    and at the process's exit CUDA may be gone already: neither is raised."""
    with contextlib.suppress(Exception):  # a finalizer has no one to tell
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _cudart_clear_error()


class _Arena:
    """One arena of staging buffers, page-locked with `pin` (a GPU rank's): unregistered by release(), or when
    the arena is collected, whichever comes first."""

    def __init__(self, nbytes: int, *, pin: bool):
        self.memory = arena(nbytes)
        self.nbytes = nbytes
        self.for_gpu = pin  # made for GPU tensors' copies (pinned unless the driver refused)
        self.pinned = 0
        self.pin_problem: str | None = None
        self._unpin = None
        if pin and nbytes:
            self.pin_problem = _pin(self.memory)
            if self.pin_problem is None:
                self.pinned = nbytes
                # holds the pointer, not the arena: a finalizer that referred to it would keep it alive
                self._unpin = weakref.finalize(self, _unpin, self.memory.data_ptr())

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()  # a finalizer runs once: later calls, and the collection, do nothing
        self.pinned = 0


class StagingPool:
    """One rank's host buffers that asynchronous saves copy their shards into, kept from save to save; the
    CheckpointManagers given the same pool (the shared and the node-local tier's: launch.checkpointing) stage in
    the same buffers, so a rank holds one staging copy of its state however many tiers save it.

    Shards that lack a buffer (or whose shape changed) get one new arena of exactly their sizes together, each
    buffer ALIGN-aligned inside it (O_DIRECT writes straight from them). On a GPU rank the arena for GPU shards is
    page-locked where it lies, with cudaHostRegister, so the device-to-host copies run asynchronously on the
    writer's copy stream; it is unregistered as soon as no buffer of the pool lies in it any more, and with the
    pool. torch's own pinned allocations (`pin_memory=True`) go through its caching host allocator, which rounds
    each one up to a power of two (up to twice the bytes, all page-locked) and never gives them back to the
    system. Buffers for CPU tensors are never pinned: on a CPU rank nothing is. A registration the driver refuses
    leaves the arena pageable (the copies are then synchronous, nothing else changes) and says why in
    `pin_problem`. (Only a GPU shows the registration itself: tests/ckpt/test_host_memory.py checks the bookkeeping
    around it with the CUDA calls stood in for, and scripts/experiments/gpu_path.py runs it on a GPU.)

    The tiers' saves can be in flight at the same time: each manager has its own writer thread, and the trainer
    waits only for the tier it is about to save to (a node-local save right after a user's asynchronous
    ctx.checkpoint.save, say). So the buffers are leased: a save takes them before it copies into them and gives
    them back when its write has ended, and a save of another manager waits in take() meanwhile. A drain reads
    node-local files, not live tensors, and runs beside node-local saves by design: it stages in the writer's
    own buffers (ShardWriter.staging), never in these."""

    POLL_S = 1.0  # how soon take() notices that the holder's writer thread died (its save will never give back)

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._arena_of: dict[str, _Arena] = {}
        self._arenas: list[_Arena] = []
        self._cv = threading.Condition()
        self._holder: object | None = None
        self._holder_alive: Callable[[], bool] = lambda: True
        self.pin_problem: str | None = None  # why the last arena that should have been pinned is not
        self.reported = False  # rank 0's manager said what the pool holds (once per pool)

    @property
    def nbytes(self) -> int:
        """Host memory the buffers take."""
        return sum(a.nbytes for a in self._arenas)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked memory the buffers take: 0 on a CPU rank."""
        return sum(a.pinned for a in self._arenas)

    def take(self, holder: object, *, alive: Callable[[], bool]) -> None:
        """Lease the buffers to `holder`'s save, waiting while another holder's save still reads them (or until its
        writer thread, asked through its `alive`, has died: that save will never read them again)."""
        with self._cv:
            while self._holder is not None and self._holder is not holder and self._holder_alive():
                self._cv.wait(self.POLL_S)
            self._holder, self._holder_alive = holder, alive

    def give_back(self, holder: object) -> None:
        """`holder`'s save no longer reads the buffers."""
        with self._cv:
            if self._holder is holder:
                self._holder = None
                self._cv.notify_all()

    def buffers(self, shards: list[LocalShard]) -> list[torch.Tensor]:
        """A buffer for each shard, shaped like its tensor: the one it had, or one of a new arena made for all the
        shards that lack one (page-locked for GPU tensors). Call it holding the lease."""
        missing = [s for s in shards if not self._fits(s)]
        for on_gpu in (False, True):
            group = list({_key(s): s for s in missing if s.tensor.is_cuda == on_gpu}.values())
            if not group:
                continue
            made = _Arena(staging_bytes(group), pin=on_gpu)
            if on_gpu:
                self.pin_problem = made.pin_problem
            self._arenas.append(made)
            for s, buf in zip(group, _carve(group, made.memory), strict=True):
                self._buffers[_key(s)], self._arena_of[_key(s)] = buf, made
        if missing:  # an arena none of whose buffers is left is given back (and unregistered) now
            used = {id(a) for a in self._arena_of.values()}
            for a in [a for a in self._arenas if id(a) not in used]:
                a.release()
                self._arenas.remove(a)
        return [self._buffers[_key(s)] for s in shards]

    def _fits(self, s: LocalShard) -> bool:
        buf = self._buffers.get(_key(s))
        return (
            buf is not None
            and buf.shape == s.tensor.shape
            and buf.dtype == s.tensor.dtype
            and self._arena_of[_key(s)].for_gpu == s.tensor.is_cuda
        )

    def close(self) -> None:
        """Unregister and drop every buffer (the pool can be used again: it makes new ones)."""
        for a in self._arenas:
            a.release()
        self._arenas, self._buffers, self._arena_of = [], {}, {}


_libc = None


def _fallocate(fd: int, length: int) -> bool:
    """fallocate(2) mode 0: allocate blocks for [0, length) without writing them. False where the filesystem
    cannot (posix_fallocate would then write zeros instead, which is worse than not reserving)."""
    global _libc
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        return _libc.fallocate(fd, 0, 0, length) == 0
    except (OSError, AttributeError):
        return False


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


SLOT = 4 << 20  # one slot of the bounce ring
SLOTS = 3  # the caller fills one while the I/O thread writes another


class DataFile:
    """One rank's data file of one save. `append` hands chunks to an I/O thread, so the caller hashes the next
    chunk while the previous one is written.

    With `direct`, it is opened with O_DIRECT: chunks go from memory to the device without passing through the
    page cache, so a save costs no copy into kernel memory and leaves no gigabytes of dirty pages for the fsync
    (and for training, during an async save) to wait on. Then every chunk starts on an ALIGN boundary; the gap
    after a chunk whose length is not a multiple of ALIGN is zero padding that no reference covers. Memory that
    is not aligned (a live tensor, in a synchronous save), and any chunk's last partial block, are copied by the
    caller into a ring of aligned bounce slots, so those copies overlap the writes too. Filesystems that refuse
    O_DIRECT (tmpfs, some FUSE mounts) get buffered writes.
    """

    def __init__(self, path: Path, *, direct: bool, bounce: torch.Tensor, reserve: int = 0):
        self.path = path
        self.offset = 0
        self.reserved = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = direct and hasattr(os, "O_DIRECT")
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self.padded = self.direct  # the layout is fixed at open, even if the writes fall back to buffered
        if self.direct and reserve:
            # O_DIRECT allocates blocks write by write, so ranks writing side by side interleave their files'
            # extents on disk (a file in many pieces) and later sequential reads seek. Reserving
            # the most this save can write keeps the file contiguous; `close` gives back what was not used.
            self.reserved = reserve if _fallocate(self.fd, reserve) else 0
        self._slots = bounce.view(SLOTS, SLOT)
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(SLOTS):
            self._free.put(i)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="ckpt-io")
        self._writes: list[Future] = []

    def append(self, chunk: torch.Tensor) -> int:
        """Queue `chunk` (1-D uint8; its memory must not change until `close`) to be written after everything
        queued before it; returns its offset in the file."""
        offset = self.offset
        n = chunk.numel()
        self.offset += aligned_size(n) if self.padded else n
        if not self.padded:
            self._submit(memoryview(chunk.numpy()), offset)
            return offset
        done = n - n % ALIGN if chunk.data_ptr() % ALIGN == 0 else 0
        if done:  # aligned: straight from the caller's memory
            self._submit(memoryview(chunk[:done].numpy()), offset)
        for start in range(done, n, SLOT):
            piece = chunk[start : start + SLOT]
            k = piece.numel()
            slot = self._free.get()  # waits while the I/O thread still writes from every slot
            buf = self._slots[slot]
            buf[:k].copy_(piece)
            end = aligned_size(k)
            buf[k:end].zero_()
            self._submit(memoryview(buf[:end].numpy()), offset + start, slot)
        return offset

    def _submit(self, view: memoryview, offset: int, slot: int | None = None) -> None:
        self._writes.append(self._io.submit(self._write, view, offset, slot))

    def _write(self, view: memoryview, offset: int, slot: int | None) -> None:
        try:
            if self.direct:
                try:
                    _pwrite_all(self.fd, view, offset)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    # The filesystem took the open but not the write: go on buffered, in the same file.
                    buffered = os.open(self.path, os.O_WRONLY)
                    os.close(self.fd)
                    self.fd, self.direct = buffered, False
            _pwrite_all(self.fd, view, offset)
        finally:
            if slot is not None:
                self._free.put(slot)

    def close(self, *, sync: bool) -> None:
        """Wait for the queued writes (raising the first one's error), fsync with `sync`, close."""
        try:
            self._io.shutdown(wait=True)
            for w in self._writes:
                w.result()
            if self.reserved > self.offset:
                os.ftruncate(self.fd, self.offset)
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, without a copy when it is contiguous on CPU."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


@dataclass(slots=True)
class PendingShard:
    shard: LocalShard
    data: torch.Tensor  # a CPU copy (async, a drain) or the live tensor's bytes on CPU (sync)


@dataclass(slots=True)
class SaveResult:
    step: int
    new_bytes: int = 0  # bytes this rank wrote
    referenced_bytes: int = 0  # bytes this rank referenced from earlier checkpoints
    seconds: float = 0.0
    removed_files: list[str] = field(default_factory=list)


class KnownChunks:
    """Committed chunks by content hash, what a save deduplicates against. The chunks this process committed
    are kept as ChunkRefs; those of a checkpoint adopted at start-up stay as that index's chunk table, sorted
    by hash and searched when asked (a ChunkRef made on a hit): at thousands of ranks an index has millions of
    chunks, and every rank adopting them one object each cost seconds and gigabytes per rank. The first
    location known for a hash is the one given, as with dict.setdefault."""

    def __init__(self) -> None:
        self._refs: dict[str, ChunkRef] = {}
        self._table: tuple | None = None  # (sorted hashes, their chunk rows, file names)
        self._gone: set[str] = set()  # files retention removed since the table was adopted

    def __len__(self) -> int:
        return len(self._refs) + (len(self._table[0]) if self._table is not None else 0)

    def get(self, digest: str) -> ChunkRef | None:
        ref = self._refs.get(digest)
        if ref is None and self._table is not None:
            ref = self._in_table(digest)
        return ref

    def _in_table(self, digest: str) -> ChunkRef | None:
        hashes, rows, files = self._table
        try:
            raw = digest.encode("ascii")
        except UnicodeEncodeError:
            return None
        at = int(np.searchsorted(hashes, np.bytes_(raw)))  # the first row of that hash: the sort was stable
        if at == len(hashes) or hashes[at] != raw:
            return None
        row = rows[at]
        file = files[int(row["file"])]
        if file in self._gone:
            return None
        return ChunkRef(digest, file, int(row["offset"]), int(row["length"]))

    def setdefault(self, digest: str, ref: ChunkRef) -> None:
        if self.get(digest) is None:
            self._refs[digest] = ref

    def adopt(self, index: Index) -> None:
        """Know exactly `index`'s chunks (a hash's first row wins); what was known before is forgotten."""
        self.clear()
        if index.tables is None:  # an index made of records (not read from a file)
            for rec in index.tensors.values():
                for shard in rec.shards:
                    for ref in shard.chunks:
                        self.setdefault(ref.hash, ref)
            return
        chunks = index.tables.chunks
        order = np.argsort(chunks["hash"], kind="stable")  # stable: the first row of a hash is found first
        self._table = (chunks["hash"][order], chunks[order], [f.decode() for f in index.tables.strings["files"]])

    def drop_files(self, gone: set[str]) -> None:
        self._refs = {h: r for h, r in self._refs.items() if r.file not in gone}
        if self._table is not None:
            self._gone |= gone

    def clear(self) -> None:
        self._refs.clear()
        self._table = None
        self._gone = set()


class ShardWriter:
    """One rank's side of saving. `known` maps chunk hashes to committed locations (for dedup).

    What a save writes is decided by content alone: every shard is copied (or read) and hashed at every save,
    and only its chunks whose hash is not stored yet are written. Nothing is skipped on a tensor's version
    counter or identity: torch's fused and foreach optimizer kernels (AdamW's default over DTensors on CUDA)
    update parameters and moments without moving either counter, and `state_dict()` hands out fresh objects
    whose id() CPython reuses, so such a shortcut kept the first save's optimizer state in every later save.
    Unchanged tensors still cost no bytes written: their chunks hash to what is stored."""

    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        group: dist.ProcessGroup | None,
        direct_io: bool = True,
        staging: StagingPool | None = None,
    ):
        self.root = root
        self.rank = rank
        self.group = group
        self.direct_io = direct_io
        self._bounce: torch.Tensor | None = None  # DataFile's aligned bounce buffer, kept across saves
        self._stream: torch.cuda.Stream | None = None  # GPU tensors are copied to host on it (snapshot)
        self.known = KnownChunks()
        # what snapshot copies into: this writer's own, or a pool shared with another tier's writer
        self.pool = staging if staging is not None else StagingPool()
        self._drain_buffers: dict[str, torch.Tensor] = {}  # what a drain reads node-local files into (staging)
        # The chunks the save in flight wrote or referenced; known (for dedup) only once it commits.
        self._candidate: list[ChunkRef] = []

    def snapshot(
        self, shards: list[LocalShard], *, copy: bool, ready: torch.cuda.Event | None = None
    ) -> list[PendingShard]:
        """Take what will be written: every shard, whatever updated it (see the class docstring). With `copy`,
        into the pool's buffers (StagingPool: the caller holds its lease), so training can go on.

        GPU tensors are copied into page-locked buffers on this writer's own copy stream, which first waits for
        `ready`: an event the training thread recorded on its stream when it asked for the save, so the copy
        sees every update queued before that (the optimizer step), whichever thread runs this. The method
        returns once those copies have landed (an event on the copy stream, not torch.cuda.synchronize(),
        which would wait on the calling thread's current device: GPU 0 on a helper thread)."""
        if not copy:
            return [PendingShard(s, s.tensor.detach().cpu()) for s in shards]  # the caller's stream, blocking
        out = []
        stream = None
        for s, buf in zip(shards, self.pool.buffers(shards), strict=True):
            if s.tensor.is_cuda:
                if stream is None:
                    stream = self._copy_stream(s.tensor.device, ready)
                with torch.cuda.stream(stream):
                    buf.copy_(s.tensor.detach(), non_blocking=True)
                s.tensor.record_stream(stream)  # its memory is not reused before the copy has read it
            else:
                buf.copy_(s.tensor.detach())
            out.append(PendingShard(s, buf))
        if stream is not None:
            landed = torch.cuda.Event(blocking=True)  # the writer thread sleeps, not spins, on a bound core
            landed.record(stream)
            landed.synchronize()
        return out

    def _copy_stream(self, device: torch.device, ready: torch.cuda.Event | None) -> torch.cuda.Stream:
        """This writer's side stream on `device`, made to wait for `ready` (or, without one, for the device's
        current stream as this thread sees it: right only on the training thread)."""
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        if ready is not None:
            self._stream.wait_event(ready)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(device))
        return self._stream

    def staging(self, shards: list[LocalShard]) -> list[torch.Tensor]:
        """The host buffers a drain reads `shards` into (their shapes and dtypes; their tensors may be meta
        tensors): the ones the last drain used, and one new arena for those that lack one. Never page-locked: a
        drain's bytes go from a file to a file and never touch a GPU. Kept for the next drain."""
        missing = list({_key(s): s for s in shards if not self._has_drain_buffer(s)}.values())
        if missing:
            self._drain_buffers.update(
                {_key(s): b for s, b in zip(missing, _carve(missing, arena(staging_bytes(missing))), strict=True)}
            )
        return [self._drain_buffers[_key(s)] for s in shards]

    def _has_drain_buffer(self, s: LocalShard) -> bool:
        buf = self._drain_buffers.get(_key(s))
        return buf is not None and buf.shape == s.tensor.shape and buf.dtype == s.tensor.dtype

    def _data_file(self, tmp: Path, reserve: int) -> DataFile:
        if self._bounce is None:
            self._bounce = arena(SLOTS * SLOT)  # huge pages: O_DIRECT pins them a third as costly
        path = tmp / "data" / f"rank-{self.rank:05d}.bin"
        return DataFile(path, direct=self.direct_io, bounce=self._bounce, reserve=reserve)

    def write(self, step: int, pending: list[PendingShard]) -> tuple[Rows, SaveResult]:
        """Write this rank's new chunks durably; returns its table rows and what it wrote."""
        t0 = time.perf_counter()
        result = SaveResult(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        final_rel = f"{step_dir_name(step)}/data/rank-{self.rank:05d}.bin"
        # every rank at once; 0755 whatever the umask: no one else may add or replace a step's files (the
        # manager made `root` so, hpcscale.util.trust.private_dir; group write inside would undo that)
        tmp.mkdir(mode=0o755, exist_ok=True)
        (tmp / "data").mkdir(mode=0o755, exist_ok=True)
        if self.rank == 0:  # who writes this save: gc leaves a .tmp-* alone while its writer runs
            from hpcscale.ckpt.retention import mark_writer

            mark_writer(tmp)
        rows = []
        out: DataFile | None = None
        new_here: dict[str, ChunkRef] = {}
        # the most this save can write: every chunk of every snapshot new, each padded to ALIGN
        most = sum(
            aligned_size(min(CHUNK_BYTES, n - start))
            for p in pending
            for n in [p.data.numel() * p.data.element_size()]
            for start in range(0, n, CHUNK_BYTES)
        )
        try:
            for p in pending:
                s = p.shard
                if dtype_name(s.tensor) not in DTYPE_SIZES:
                    raise ValueError(f"tensor {s.name}: dtype {s.tensor.dtype} has no plain bytes to checkpoint")
                refs = []
                flat = tensor_bytes(p.data)
                for start in range(0, max(flat.numel(), 1), CHUNK_BYTES):
                    piece = flat[start : start + CHUNK_BYTES]
                    digest = xxhash.xxh3_128_hexdigest(memoryview(piece.numpy()))
                    ref = self.known.get(digest) or new_here.get(digest)
                    if ref is None:
                        out = out or self._data_file(tmp, most)
                        ref = ChunkRef(digest, final_rel, out.append(piece), piece.numel())
                        new_here[digest] = ref
                        result.new_bytes += piece.numel()
                    else:
                        result.referenced_bytes += ref.length
                    refs.append(ref)
                self._candidate += refs
                rows.append((s.name, s.global_shape, dtype_name(s.tensor), s.offset, tuple(s.tensor.shape), refs))
            fault("data_written", self.rank)
        except BaseException:
            if out is not None:
                with contextlib.suppress(Exception):  # the error in hand is the one to report
                    out.close(sync=False)
            raise
        if out is not None:
            out.close(sync=True)
        fsync_dir(tmp / "data")
        fault("data_durable", self.rank)
        result.seconds = time.perf_counter() - t0
        return rows_of(rows), result

    def committed(self, removed_files: list[str]) -> None:
        """The save in flight is committed: its chunks become known (dedup), minus files retention removed."""
        for ref in self._candidate:
            self.known.setdefault(ref.hash, ref)
        self._candidate.clear()
        if removed_files:
            gone = set(removed_files)
            self.known.drop_files(gone)

    def failed(self) -> None:
        """The save in flight did not commit: forget what it wrote."""
        self._candidate.clear()

    def adopt(self, index: Index) -> None:
        """Dedup against a checkpoint loaded at start-up."""
        self.known.adopt(index)

    def forget(self) -> None:
        """The next save writes every chunk of every tensor into its own files, referencing nothing saved before
        (a node-local save: each step must stand alone)."""
        self.known.clear()


def commit(
    root: Path,
    step: int,
    gathered: list[dict],
    *,
    layout: dict,
    parent: str | None,
    trainer_state: dict,
    keep_last: int,
    keep_every: int,
    keep: frozenset[int] = frozenset(),
    created: float | None = None,
) -> list[str]:
    """Rank 0: build and write the index, rename everything into place, apply retention (`keep`: steps it keeps
    whatever the policy says; `created`: when the state was taken, now unless given).
    Returns the data files retention removed."""
    prepare_index(root, step, gathered, layout=layout, parent=parent, trainer_state=trainer_state, created=created)
    return install(root, step, keep_last=keep_last, keep_every=keep_every, keep=keep)


def prepare_index(
    root: Path,
    step: int,
    gathered: list[dict],
    *,
    layout: dict,
    parent: str | None,
    trainer_state: dict,
    created: float | None = None,
) -> Index:
    """Write `.tmp-step-N/index.h5` and `DIGEST`, both durable (the first half of commit); returns the index."""
    tmp = root / f".tmp-{step_dir_name(step)}"
    index = index_of_rows(
        gathered,
        step=step,
        layout=layout,
        parent=parent,
        created=time.time() if created is None else created,
        trainer_state=trainer_state,
        chunk_bytes=CHUNK_BYTES,  # where this module cut the chunks (tests cut smaller ones)
    )
    digest = write_index(tmp / f"{INDEX}.tmp", index)
    os.chmod(tmp / f"{INDEX}.tmp", 0o644)  # HDF5 creates it 0666 less the umask: group-writable under umask 002
    write_digest_file(tmp, digest)  # inside the directory the rename below commits, with the index
    os.replace(tmp / f"{INDEX}.tmp", tmp / INDEX)
    index.digest = digest
    return index


def install(root: Path, step: int, *, keep_last: int, keep_every: int, keep: frozenset[int] = frozenset()) -> list[str]:
    """The second half of commit: `.tmp-step-N` (its index and DIGEST in place) becomes `step-N`, LATEST names
    it, retention runs. Returns the data files retention removed."""
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}"
    from hpcscale.ckpt.retention import WRITER

    (tmp / WRITER).unlink(missing_ok=True)  # an unfinished save's mark: a committed one needs none
    fsync_dir(tmp)
    fault("index_written", 0)
    final = root / name
    if final.exists():  # never replace a committed checkpoint: later ones may reference its data files
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileExistsError(f"{final} is already committed")
    os.replace(tmp, final)
    fsync_dir(root)
    atomic_write(root / LATEST, name + "\n")
    from hpcscale.ckpt.retention import apply_retention

    # own_saves: this save is committed and the job runs one at a time, so any .tmp-* left is a crashed one
    return apply_retention(root, keep_last=keep_last, keep_every=keep_every, keep=keep, own_saves=True)

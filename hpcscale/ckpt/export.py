"""`hpcscale ckpt export`: one consolidated model (full tensors, model weights only) for inference.

What a checkpoint declares is not what it stores: chunks are content-addressed, so a tensor of zeros, or many
tensors with the same bytes, are one stored chunk referenced many times, and an index of a few megabytes may
declare terabytes that verify (each distinct chunk is read once). That expansion is legitimate, so the export
bounds what it costs instead of refusing it:

1. The target is checked before anything is read: the output's directory is opened once without following a
   symbolic link (O_DIRECTORY|O_NOFOLLOW) and a temporary of a random name is created in it at once with
   O_CREAT|O_EXCL|O_NOFOLLOW, mode 0666 less the umask (as any file the user writes); a missing or unwritable
   directory, a directory or a FIFO at the target, is bad input (exit 2) before a byte of the checkpoint is read.
2. The index is checked whole and every data file it references is in place (`ckpt verify`'s checks 1 to 3):
   exit 3, nothing written, otherwise.
3. Every exported tensor is checked against what the format can hold (safetensors: its dtypes, the reserved
   key `__metadata__`, its header limit): exit 2 naming the tensor, nothing written.
4. The declared bytes are checked against the free space of the output's filesystem and the process's file
   size limit (exit 2 naming the largest tensor), before any chunk is read.
5. The file is written tensor by tensor, each in blocks of at most BLOCK_BYTES of its row-major bytes (a block:
   one index along the leading dimensions, a range along one, the whole extent after it, so each saved shard
   holds its part of a block contiguously), each block filled chunk by chunk (reader.fill_box: a chunk read and
   hashed whole, a piece of PIECE_BYTES at a time). So the export holds at most BLOCK_BYTES + PIECE_BYTES of
   tensor data whatever the checkpoint declares; a chunk's hash failing stops it with exit 3.
6. The temporary is fsync'd and renamed over the target (a symbolic link there is replaced, never followed),
   then the directory fsync'd. On any failure the temporary is removed and the target left as it was.

A chunk that several blocks need is read (and hashed) once per block: reading costs at most the bytes written
plus two chunks per saved shard and block.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import resource
import stat
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcscale.ckpt.format import INDEX, Index, TensorView, read_index, tensor_view
from hpcscale.ckpt.integrity import DTYPE_SIZES
from hpcscale.ckpt.ops import data_file_problem, size_text
from hpcscale.ckpt.reader import ChunkReader, fill_box
from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure

# the public API (docs/context-api.md, docs/huggingface.md, docs/checkpoint-format.md): what user code imports
__all__ = ["consolidated", "export"]

BLOCK_BYTES = 64 << 20  # one block of a tensor's bytes, filled and written at a time (the export's memory bound)
FORMATS = ("torch", "safetensors")
PREFIX = "model/"  # what is exported: the model's tensors, named without it
# safetensors' names for torch dtypes (safetensors.torch._TYPES); a dtype missing here cannot be loaded from it
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
}
SAFETENSORS_RESERVED = "__metadata__"  # the header's key for string metadata: no tensor may have this name
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors refuses to open a file whose header is longer
TORCH_OVERHEAD = 1024  # bytes per tensor a torch.save file adds beyond the data, at most (zip records, pickle)


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of the export."""

    view: TensorView  # the tensor in the checkpoint (name with the prefix)
    key: str  # its name in the exported file
    elt: int  # element size in bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return self.view.global_shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.elt


def entries(index: Index, prefix: str = PREFIX) -> list[Entry]:
    """The `prefix` tensors of a checked index, in name order, without building their shards' records."""
    out = []
    for name in index.tensors:
        if name.startswith(prefix):
            view = tensor_view(index, name)
            out.append(Entry(view, name.removeprefix(prefix), DTYPE_SIZES[view.dtype]))
    return sorted(out, key=lambda e: e.view.name)


def blocks(shape: tuple[int, ...], elt: int, limit: int = BLOCK_BYTES) -> Iterator[tuple[list[int], list[int], int]]:
    """(lo, hi, first byte) of each block of a tensor's row-major bytes, in order: blocks of at most `limit`
    bytes (one element at least) that are boxes whose overlap with any saved shard is contiguous in the shard.
    Dimension k is the first whose trailing extent (the elements after it) fits in `limit`: a block is one index
    along the dimensions before k, a range of rows along k, and everything after k."""
    if 0 in shape:
        return
    if not shape:
        yield [], [], 0
        return
    k = 0
    while math.prod(shape[k + 1 :]) * elt > limit:
        k += 1
    row = math.prod(shape[k + 1 :]) * elt
    step = max(1, limit // row)
    for prefix in np.ndindex(*shape[:k]):
        for a in range(0, shape[k], step):
            b = min(shape[k], a + step)
            lo = [*prefix, a] + [0] * (len(shape) - k - 1)
            hi = [x + 1 for x in prefix] + [b, *shape[k + 1 :]]
            first = 0
            for x, n in zip(lo, shape, strict=True):
                first = first * n + x
            yield lo, hi, first * elt


def consolidated(step_dir: Path, *, prefix: str = PREFIX) -> dict:
    """Every `prefix` tensor whole, in memory, every chunk's hash checked (cross-site rounds, tests). Refused
    before allocating when the tensors declare more bytes than this machine has memory (BadInput, naming the
    largest); VerificationFailure (exit 3) when the index or a chunk fails."""
    import torch

    from hpcscale.ckpt.reader import torch_dtype

    index = _checked_index(step_dir)
    todo = entries(index, prefix)
    total = sum(e.nbytes for e in todo)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if total > memory:
        raise BadInput(f"{step_dir}: {_declared(index, todo, total)}, more than this machine's {size_text(memory)}")
    reader = ChunkReader(step_dir.parent)
    out = {}
    try:
        for e in todo:
            t = torch.empty(e.shape, dtype=torch_dtype(e.view.dtype))
            raw = t.reshape(-1).view(torch.uint8).numpy().reshape((*e.shape, e.elt))
            fill_box(reader, e.view, index.chunk_bytes, [0] * len(e.shape), list(e.shape), raw)
            out[e.key] = t
    finally:
        reader.close()
    return out


def export(step_dir: Path, fmt: str, out: Path) -> dict:
    """Write the checkpoint's model to `out` in `fmt` (module docstring: the order of checks, the bounds)."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown export format '{fmt}' (torch, safetensors)")
    with Target(out) as target:  # before anything is read
        index = _checked_index(step_dir)
        todo = entries(index)
        if fmt == "safetensors":
            header, todo = safetensors_header(todo)
            size = len(header) + sum(e.nbytes for e in todo)
        else:
            header, size = b"", sum(e.nbytes + TORCH_OVERHEAD for e in todo) + TORCH_OVERHEAD
        target.check_room(size, lambda: _declared(index, todo, sum(e.nbytes for e in todo)))
        reader = ChunkReader(step_dir.parent)
        try:
            block = np.empty(BLOCK_BYTES, dtype=np.uint8)
            if fmt == "safetensors":
                target.write(header, 0)
                at = len(header)
                for e in todo:
                    _write_tensor(reader, index, e, target, at, block)
                    at += e.nbytes
            else:
                _write_torch(reader, index, todo, target, block)
        finally:
            reader.close()
        target.commit()
    return {
        "out": str(out),
        "format": fmt,
        "tensors": len(todo),
        "parameters": sum(math.prod(e.shape) for e in todo),
        "bytes": sum(e.nbytes for e in todo),
    }


def _checked_index(step_dir: Path) -> Index:
    """The index checked whole (digest, structure), and every data file it references in place."""
    index = read_index(step_dir / INDEX)
    problem = data_file_problem(step_dir.parent, index)
    if problem:
        raise VerificationFailure(f"{step_dir}: {problem}")
    return index


def _declared(index: Index, todo: list[Entry], total: int) -> str:
    """What the export's tensors declare, the largest named, against what the data files store."""
    text = f"its model tensors declare {size_text(total)} ({total} bytes)"
    if todo:
        big = max(todo, key=lambda e: e.nbytes)
        text += f", the largest tensor {big.view.name} {size_text(big.nbytes)}"
    return text + f"; its data files store {size_text(index.stored_bytes())} of distinct chunks"


def safetensors_header(todo: list[Entry]) -> tuple[bytes, list[Entry]]:
    """(the header: its 8-byte length and JSON padded to 8 bytes, the tensors in the order their bytes follow).
    Larger elements first, then by name, as safetensors itself orders them (every tensor aligned to its
    element). BadInput naming the tensor that safetensors cannot hold, or when the header is over its limit."""
    for e in todo:
        if e.key == SAFETENSORS_RESERVED:
            raise BadInput(
                f"tensor {e.view.name}: safetensors reserves the name {SAFETENSORS_RESERVED} for its metadata "
                "(a file with a tensor of that name cannot be opened); export with --format torch"
            )
        if e.view.dtype not in SAFETENSORS_DTYPES:
            raise BadInput(
                f"tensor {e.view.name}: safetensors has no dtype {e.view.dtype} "
                f"(it holds {', '.join(sorted(SAFETENSORS_DTYPES))}); export with --format torch"
            )
    order = sorted(todo, key=lambda e: (-e.elt, e.key))
    header, at = {}, 0
    for e in order:
        header[e.key] = {
            "dtype": SAFETENSORS_DTYPES[e.view.dtype],
            "shape": list(e.shape),
            "data_offsets": [at, at + e.nbytes],
        }
        at += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()  # ASCII: names escaped as \\uXXXX
    text += b" " * (-len(text) % 8)
    if len(text) > SAFETENSORS_MAX_HEADER:
        raise BadInput(
            f"the safetensors header of {len(order)} tensors would be {len(text)} bytes, over the format's limit "
            f"of {SAFETENSORS_MAX_HEADER} (safetensors refuses to open such a file); export with --format torch"
        )
    return struct.pack("<Q", len(text)) + text, order


def _write_tensor(
    reader: ChunkReader, index: Index, e: Entry, target: Target, at: int, block: np.ndarray, *, crc: int | None = None
) -> int | None:
    """Write tensor `e`'s row-major bytes at `at`, a block at a time; with `crc` (a start value), returns their
    CRC-32 (what a zip record holds)."""
    for lo, hi, first in blocks(e.shape, e.elt):
        n = math.prod(y - x for x, y in zip(lo, hi, strict=True)) * e.elt
        view = block[:n].reshape((*(y - x for x, y in zip(lo, hi, strict=True)), e.elt))
        fill_box(reader, e.view, index.chunk_bytes, lo, hi, view)
        target.write(block[:n], at + first)
        if crc is not None:
            crc = zlib.crc32(block[:n], crc)
    return crc


def _write_torch(reader: ChunkReader, index: Index, todo: list[Entry], target: Target, block: np.ndarray) -> None:
    """A `torch.save` file of {name: tensor}: torch writes the archive with every storage's bytes left as a hole
    (`torch.serialization.skip_data`, over tensors that hold no memory: FakeTensor), then each tensor's bytes
    are written into its record a block at a time and the record's CRC-32 set, so the file is what torch.save
    of the whole tensors writes and never more than a block of them is in memory."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hpcscale.ckpt.reader import torch_dtype

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental": it only holds bytes here
        fakes = {e.key: torch.empty(e.shape, dtype=torch_dtype(e.view.dtype)) for e in todo}
    try:
        with os.fdopen(os.dup(target.fd), "wb") as fh, torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fakes, fh)  # storages are numbered in the order they are pickled: the dict's
    except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as RuntimeError
        raise RuntimeFailure(f"{target.out}: writing the export failed ({str(e)[:200]}); nothing written") from None
    records = _zip_records(target.fd)
    for k, e in enumerate(todo):
        rec = records.get(f"data/{k}")
        if rec is None or rec.size != e.nbytes:
            raise RuntimeFailure(f"torch.save laid out tensor {e.view.name} in a way this export does not know")
        crc = _write_tensor(reader, index, e, target, rec.data, block, crc=0)
        for where in rec.crc_at:
            target.write(struct.pack("<I", crc), where)


@dataclass(frozen=True, slots=True)
class _ZipRecord:
    data: int  # where its bytes start
    size: int
    crc_at: tuple[int, ...]  # where its CRC-32 is recorded (data descriptor or local header, central directory)


def _zip_records(fd: int) -> dict[str, _ZipRecord]:
    """The stored (uncompressed) records of the zip archive on `fd`, by name without the archive's top folder."""
    out = {}
    with os.fdopen(os.dup(fd), "rb") as fh, zipfile.ZipFile(fh) as z:
        central = {}
        at = getattr(z, "start_dir", None)  # where the central directory starts (zipfile reads it there)
        if at is None:
            raise RuntimeFailure("this Python's zipfile does not say where an archive's directory starts")
        for _ in z.infolist():
            head = os.pread(fd, 46, at)
            n, m, k = struct.unpack("<HHH", head[28:34])
            central[os.pread(fd, n, at + 46).decode("utf-8")] = at + 16
            at += 46 + n + m + k
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise RuntimeFailure(f"torch.save compressed record {info.filename}: this export cannot fill it")
            local = os.pread(fd, 30, info.header_offset)
            n, m = struct.unpack("<HH", local[26:30])
            data = info.header_offset + 30 + n + m
            crc_at = [central[info.filename]]
            if info.flag_bits & 0x08:  # a data descriptor after the bytes: optional signature, then the CRC
                tail = data + info.file_size
                crc_at.append(tail + 4 if os.pread(fd, 4, tail) == b"PK\x07\x08" else tail)
            else:
                crc_at.append(info.header_offset + 14)
            out[info.filename.split("/", 1)[-1]] = _ZipRecord(data, info.file_size, tuple(crc_at))
    return out


class Target:
    """The output file: its directory opened once without following a link, a fresh temporary created in it
    (O_CREAT|O_EXCL|O_NOFOLLOW, mode 0666 less the umask), written, then renamed over the name. Used as a
    context manager: on any exit but after commit(), the temporary is removed and the name left as it was."""

    def __init__(self, out: Path):
        self.out = out
        self.name = out.name
        parent = out.parent
        if self.name in ("", ".", ".."):
            raise BadInput(f"-o {out}: not a file name")
        try:
            self.dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BadInput(f"-o {out}: the directory {parent} does not exist") from None
        except OSError as e:
            if e.errno == errno.ELOOP or os.path.islink(parent):  # O_DIRECTORY|O_NOFOLLOW on a link: ENOTDIR
                raise BadInput(
                    f"-o {out}: {parent} is a symbolic link; the export writes only into a real directory "
                    f"(give the directory it leads to)"
                ) from None
            if e.errno == errno.ENOTDIR:
                raise BadInput(f"-o {out}: {parent} is not a directory") from None
            raise BadInput(f"-o {out}: cannot open the directory {parent} ({e.strerror})") from None
        self.fd = -1
        self.tmp = f".{self.name}.{os.urandom(8).hex()}.tmp"
        try:
            self._check_name()
            try:
                self.fd = os.open(
                    self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=self.dfd
                )
            except OSError as e:
                raise BadInput(f"-o {out}: cannot create a file in {parent} ({e.strerror})") from None
        except BaseException:
            os.close(self.dfd)
            raise

    def _check_name(self) -> None:
        """A file or a symbolic link at the name is replaced (a link never followed); anything else is refused."""
        try:
            st = os.lstat(self.name, dir_fd=self.dfd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"-o {self.out}: is a directory; give a file name")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise BadInput(
                f"-o {self.out}: exists and is not a regular file (a FIFO, a device or a socket); not replaced"
            )

    def check_room(self, size: int, declared) -> None:
        """BadInput before anything is read when `size` bytes cannot fit: the free space of the directory's
        filesystem (for an unprivileged user), or this process's file size limit (`ulimit -f`)."""
        st = os.fstatvfs(self.dfd)
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise BadInput(
                f"-o {self.out}: the export would be {size_text(size)}, and its filesystem has {size_text(free)} "
                f"free: {declared()}"
            )
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and size > limit:
            raise BadInput(
                f"-o {self.out}: the export would be {size_text(size)}, over this process's file size limit "
                f"of {size_text(limit)} (ulimit -f): {declared()}"
            )

    def write(self, data, at: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
        except OSError as e:
            raise RuntimeFailure(f"{self.out}: writing the export failed ({e.strerror}); nothing written") from None

    def commit(self) -> None:
        try:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            self._check_name()  # something else put there meanwhile is not replaced either
            os.replace(self.tmp, self.name, src_dir_fd=self.dfd, dst_dir_fd=self.dfd)
            self.tmp = None
            os.fsync(self.dfd)
        except OSError as e:
            raise RuntimeFailure(f"{self.out}: finishing the export failed ({e.strerror}); nothing written") from None

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp, dir_fd=self.dfd)
        os.close(self.dfd)

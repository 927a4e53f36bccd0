"""JSON input with bounds: size, nesting and values are checked while parsing, never after building.

Every JSON document hpcscale reads from a file someone else could have written (manifests, checkpoint
metadata, records, the coming cross-site rounds) goes through `load_json`. It refuses, as BadInput (exit 2)
naming the source and the line, and in well under a second:
- a document larger than `max_bytes` (checked before reading it);
- nesting deeper than the interpreter can recurse (the C parser raises RecursionError long before memory
  runs out; JSON has no aliases, so a document cannot expand beyond its own size);
- NaN, Infinity and numbers that overflow a float (`1e999`): JSON's grammar has no such values, and a size
  or a time that is not finite is never meant;
- integers longer than 4,300 digits (Python refuses to convert them; we say so instead of a traceback);
- text that is not UTF-8.
A million-entry manifest (~100 MB) parses at nearly the C parser's speed: one hook runs on floats only.

Files are read through `read_bounded` (a whole file up to a size) or `read_tail` (only the last bytes of a log
or a JSON-lines file, however long it is): both open with O_NONBLOCK and check fstat on that descriptor, so a
FIFO or a device planted in a run directory (a symlink to /dev/zero) is refused, never waited on or read.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcscale.errors import BadInput
from hpcscale.portable import files

MiB = 1 << 20
DEFAULT_MAX_BYTES = 1024 * MiB


class _Refused(ValueError):
    pass


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON value")


def loads_json(text: str | bytes, *, source: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Parse one JSON document from memory under the bounds above; `source` names it in errors."""
    if len(text) > max_bytes:
        raise BadInput(f"{source}: {len(text)} bytes, over the limit of {max_bytes} for this input")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return json.loads(text, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise BadInput(f"{source}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except _Refused as e:
        raise BadInput(f"{source}: invalid JSON: {e}") from None
    except ValueError as e:  # an integer over Python's 4,300-digit conversion limit
        raise BadInput(f"{source}: invalid JSON: {e}") from None
    except RecursionError:
        raise BadInput(f"{source}: invalid JSON: nested too deeply") from None


def read_bounded(path: str | Path, *, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of a regular file of at most `max_bytes`, read once. Opened with O_NONBLOCK and checked with
    fstat on that descriptor (no window between the check and the open): a FIFO or device is refused without
    waiting on it. Any failure is BadInput naming the file."""
    p = Path(path)
    try:
        return files.read_regular(p, max_bytes=max_bytes)[0]
    except OSError as e:
        raise BadInput(f"{p}: {file_problem(e, what)}") from None


def file_problem(e: OSError, what: str = "file") -> str:
    """What went wrong, in words, when hpcscale.portable.files opened or read a `what` (for a message that
    names the file first)."""
    if isinstance(e, FileNotFoundError):
        return f"no such {what}"
    if isinstance(e, files.NotRegularFile):
        return "not a regular file"
    if isinstance(e, files.TooLarge):
        return f"{e.size} bytes, over the limit of {e.limit} for a {what}"
    if e.errno == errno.ELOOP:
        return f"is a symlink; a {what} is read only as a regular file"
    return f"cannot read the {what} ({e.strerror})"


def _open_regular(p: Path, what: str) -> tuple[int, os.stat_result]:
    """A descriptor of the regular file `p` (O_NONBLOCK: a FIFO is never waited on) and its fstat; BadInput
    naming the file for anything else (FileNotFoundError passes)."""
    try:
        return files.open_regular(p)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise BadInput(f"{p}: {file_problem(e, what)}") from None


@dataclass(frozen=True, slots=True)
class Tail:
    data: bytes  # whole lines only when `cut` (the partial first line is dropped)
    cut: int  # bytes before `data` that were not read (0: the whole file)


def read_tail(path: str | Path, *, max_bytes: int, what: str = "file", missing_ok: bool = False) -> Tail | None:
    """At most the last `max_bytes` of a regular file, read with pread from that offset (a file of any size,
    growing or not, costs at most `max_bytes`). Opened with O_NONBLOCK and checked with fstat on that
    descriptor: a FIFO or a device (a symlink to /dev/zero) is refused (BadInput), never waited on or read.
    When the file is longer, the partial line the cut falls in is dropped. A missing file: None with
    `missing_ok`, else BadInput."""
    p = Path(path)
    try:
        fd, st = _open_regular(p, what)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise BadInput(f"{p}: no such {what}") from None
    try:
        size = st.st_size
        start = max(0, size - max_bytes)
        chunks, offset = [], start
        while offset < size:
            chunk = os.pread(fd, min(8 * MiB, size - offset), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise BadInput(f"{p}: cannot read the {what} ({e.strerror})") from None
    finally:
        os.close(fd)
    if start:
        newline = data.find(b"\n")
        dropped = len(data) if newline < 0 else newline + 1
        data, start = data[dropped:], start + dropped
    return Tail(data, start)


def load_json(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES, what: str = "file") -> Any:
    """Read and parse a JSON file under the bounds above (read_bounded, then loads_json)."""
    return loads_json(read_bounded(path, max_bytes=max_bytes, what=what), source=str(path), max_bytes=max_bytes)

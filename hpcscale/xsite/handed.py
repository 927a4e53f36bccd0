"""The global rounds a site's tick hands to its run, and how its trainer takes one (docs/cross-site.md).

    RUN/xsite/                        made by the tick; only the user (or root) can write it
      global-rNNNNNN.safetensors      θ(r), written whole (a fresh name, then a rename)
      handed.json                     the record: each round handed over and still kept, with its file's
                                      sha256 and size (docs/cross-site-format.md); written after θ

What was handed over is what the record says, never a file name. RUN usually sits on a shared filesystem, and
a name there (a stray `touch`, a colleague's file) must neither stop the rounds (an aggregator that reads a
newer round in its run's names thinks its state was restored and publishes nothing) nor reach a model:
1. RUN/xsite is made by a mkdir that fails when the name exists (hpcscale.util.trust.private_dir, mode 0755
   whatever the umask); one that exists is kept only if it is the user's or root's and writable by no one
   else. Every use, a tick's or a trainer's, opens it again without following a symbolic link, checks that on
   the descriptor, and opens what is in it relative to that descriptor with O_NOFOLLOW, never waiting on a FIFO.
2. A hand-over writes θ(r) first, then the record naming it. A tick killed between the two leaves a file the
   record does not name, which is nothing; the next tick writes both again.
3. The record is read as hpcscale.util.trust.read_trusted reads configuration (a regular file of the user's or
   root's that no one else can write, checked on the descriptor read; at most RECORD_MAX_BYTES) and parsed
   strictly. Anything else is a `RecordError` naming the path and the fix: the tick reports it at every tick and
   writes nothing over it; a trainer trains on without a round.
4. A trainer loads θ(r) only from a regular file of the user's or root's, of the record's size, whose sha256 is
   the record's, hashed from the descriptor it is then loaded from; otherwise `Refused` (that round is skipped,
   training goes on, a later round is taken).
5. Retention drops rounds from the record before it deletes their files, and never drops the newest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcscale.errors import BadInput
from hpcscale.portable import files
from hpcscale.portable.hashing import SHA256  # the record names each file's digest by its algorithm
from hpcscale.util import trust

if TYPE_CHECKING:  # torch only where θ is loaded: a tick with nothing to hand over needs none of it
    import torch

GLOBAL_DIR = "xsite"  # in the run directory
RECORD = "handed.json"
FORMAT = 1
RECORD_MAX_BYTES = 1 << 20  # an entry is ~150 bytes
MAX_ENTRIES = 1000  # the newest rounds listed; retention keeps `keep_rounds` (10 by default) of them
MAX_THETA_BYTES = 1 << 42  # a θ file the record says is larger than 4 TiB is not one the tick wrote
MAX_ROUND = 999_999  # six digits, as every record of the rounds names them
WHAT = "directory of the global weights handed to the run"
_NAME = re.compile(r"global-r(\d{6})\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_READ = 8 << 20  # bytes hashed per read


class RecordError(Exception):
    """RUN/xsite or its record cannot be trusted or read (the message names the path and the fix). Not BadInput:
    what another user did to a run directory stops neither a tick's other stages nor a training."""


class Refused(Exception):
    """A handed round's θ file is not the one the record names (the message names the path and why)."""


@dataclass(frozen=True, slots=True)
class Handed:
    """One round handed to the run: its file in RUN/xsite, and that file's sha256 and size."""

    round: int
    file: str
    sha256: str
    bytes: int

    def to_json(self) -> dict:
        return asdict(self)


def global_name(r: int) -> str:
    return f"global-r{r:06d}.safetensors"


def global_path(run: Path, r: int) -> Path:
    """Where θ(r) handed to a run lies (what the record names; the name alone says nothing)."""
    return run / GLOBAL_DIR / global_name(r)


# ---- reading -------------------------------------------------------------------------------------------------------
def entries(run: Path) -> list[Handed]:
    """The rounds handed to `run` and kept, oldest first ([] when none was yet). RecordError when RUN/xsite or
    its record is not to be trusted or does not read."""
    fd = _open_dir(run, make=False)
    if fd is None:
        return []
    try:
        return _read_record(fd, run / GLOBAL_DIR / RECORD)
    finally:
        os.close(fd)


def latest(run: Path) -> Handed | None:
    """The newest round handed to `run` (None: none yet). RecordError as `entries`."""
    found = entries(run)
    return found[-1] if found else None


def load(run: Path, entry: Handed) -> dict[str, torch.Tensor]:
    """θ of a handed round, from the file the record names, only if it is that file (4. above); Refused
    otherwise, RecordError when RUN/xsite itself is not to be trusted."""
    fd = _open_dir(run, make=False)
    path = run / GLOBAL_DIR / entry.file
    if fd is None:
        raise Refused(f"{path.parent}: missing")
    try:
        try:
            f = os.open(entry.file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            why = "a symbolic link, not the file the tick wrote" if e.errno == errno.ELOOP else e.strerror
            raise Refused(f"{path}: {why}") from None
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(f"{path}: not a regular file")
            why = trust.problem(st)
            if why is not None:
                raise Refused(f"{path}: {why}")
            if st.st_size != entry.bytes:
                raise Refused(f"{path}: {st.st_size} bytes, and the record of the rounds handed over says "
                              f"{entry.bytes}: not the file the sync tick wrote")  # fmt: skip
            if _sha256(f, entry.bytes) != entry.sha256:
                raise Refused(f"{path}: its sha256 is not the one the record of the rounds handed over names: "
                              "not the file the sync tick wrote")  # fmt: skip
            return _load_fd(f, path)
        finally:
            os.close(f)
    finally:
        os.close(fd)


def _sha256(fd: int, size: int) -> str:
    h = hashlib.sha256()
    done = 0
    while done < size:
        chunk = os.pread(fd, min(_READ, size - done), done)
        if not chunk:
            break
        h.update(chunk)
        done += len(chunk)
    return h.hexdigest() if done == size else ""


def _load_fd(fd: int, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the file open as `fd` (the one just hashed, whatever its name leads to meanwhile)."""
    from safetensors.torch import load, load_file

    try:
        if os.path.isdir("/proc/self/fd"):  # the open file itself, mapped: no second copy of θ in memory
            return load_file(f"/proc/self/fd/{fd}")
        return load(os.pread(fd, os.fstat(fd).st_size, 0))
    except Exception as e:  # safetensors' own error type: the file is the tick's, so this is a damaged disk
        raise Refused(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from None


# ---- writing (the tick) ------------------------------------------------------------------------------------------
def write(run: Path, r: int, data: bytes) -> Handed:
    """Hand θ(r) (`data`, a safetensors file) to `run`: RUN/xsite made or checked (1.), θ written, then the
    record (2.). RecordError when RUN/xsite or its record is not to be trusted: nothing is written there."""
    fd = _open_dir(run, make=True)
    assert fd is not None
    try:
        found = _read_record(fd, run / GLOBAL_DIR / RECORD)  # one that does not read is never written over
        entry = Handed(round=r, file=global_name(r), sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        files.atomic_write(entry.file, data, dir_fd=fd, mode=0o644, exact_mode=True)
        kept = sorted([e for e in found if e.round != r] + [entry], key=lambda e: e.round)[-MAX_ENTRIES:]
        _write_record(fd, kept)
        return entry
    finally:
        os.close(fd)


def prune(run: Path, oldest: int) -> int:
    """Drop the rounds before `oldest` from the record (never the newest), then delete their files and any other
    global-rNNNNNN file numbered before `oldest` (regular files only, by name in the checked directory).
    Returns the files deleted. RecordError as `entries`: then nothing is deleted."""
    fd = _open_dir(run, make=False)
    if fd is None:
        return 0
    try:
        found = _read_record(fd, run / GLOBAL_DIR / RECORD)
        kept = [e for e in found if e.round >= oldest] or found[-1:]
        if len(kept) != len(found):
            _write_record(fd, kept)
        keep = {e.file for e in kept}
        removed = 0
        for name in os.listdir(fd):
            m = _NAME.fullmatch(name)
            if not m or int(m.group(1)) >= oldest or name in keep:
                continue
            try:
                if stat.S_ISREG(os.lstat(name, dir_fd=fd).st_mode):
                    os.unlink(name, dir_fd=fd)
                    removed += 1
            except FileNotFoundError:
                pass
        return removed
    finally:
        os.close(fd)


def _write_record(fd: int, kept: list[Handed]) -> None:
    doc = {"format": FORMAT, "rounds": [e.to_json() for e in kept]}
    files.atomic_write(RECORD, json.dumps(doc, indent=1).encode(), dir_fd=fd, mode=0o644, exact_mode=True)


# ---- the directory and the record ----------------------------------------------------------------------------------
def _open_dir(run: Path, *, make: bool) -> int | None:
    """A descriptor of RUN/xsite checked on itself (1.); None when it does not exist (and `make` is false)."""
    d = run / GLOBAL_DIR
    if make:
        try:
            trust.private_dir(d, what=WHAT, mode=0o755, below=run)
        except BadInput as e:
            raise RecordError(str(e)) from None
    try:
        rfd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RecordError(f"{run}: cannot open the run directory ({e.strerror})") from None
    try:
        fd = os.open(GLOBAL_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=rfd)  # fmt: skip
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise RecordError(f"{d}: cannot open the {WHAT} ({e.strerror})") from None
        kind = "a symbolic link" if os.path.islink(d) else "not a directory"
        raise RecordError(
            f"{d}: refusing the {WHAT}: {kind}; hpcscale hands global weights over only in a real directory of "
            f"its own. Fix: remove {d} if it is not yours to keep (the next sync tick makes the directory)"
        ) from None
    finally:
        os.close(rfd)
    try:
        trust.check_dir_fd(fd, d, what=WHAT)
    except BadInput as e:
        os.close(fd)
        raise RecordError(str(e)) from None
    return fd


def _read_record(fd: int, path: Path) -> list[Handed]:
    what = "record of the rounds handed to the run"

    def trusted(st: os.stat_result) -> None:
        why = trust.problem(st)
        if why is not None:
            raise RecordError(str(trust.refuse(path, st, why, what=what)))

    try:
        data, _ = files.read_regular(RECORD, max_bytes=RECORD_MAX_BYTES, dir_fd=fd, follow_symlinks=False,
                                     check=trusted)  # fmt: skip
    except FileNotFoundError:
        return []
    except files.TooLarge:
        raise RecordError(_malformed(path, f"over {RECORD_MAX_BYTES} bytes")) from None
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise RecordError(_malformed(path, why)) from None
    return parse_record(data, path)


def parse_record(data: bytes, path: Path) -> list[Handed]:
    """The entries of a record's bytes, oldest first; RecordError for anything the tick does not write."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise RecordError(_malformed(path, "not JSON")) from None
    if not isinstance(doc, dict) or set(doc) != {"format", "rounds"} or doc["format"] != FORMAT:
        raise RecordError(_malformed(path, f"not an object of format {FORMAT} with fields format and rounds"))
    listed = doc["rounds"]
    if not isinstance(listed, list) or len(listed) > MAX_ENTRIES:
        raise RecordError(_malformed(path, f"rounds is not a list of at most {MAX_ENTRIES}"))
    out: list[Handed] = []
    for i, e in enumerate(listed):
        problem = _entry_problem(e)
        if problem is None and out and e["round"] <= out[-1].round:
            problem = "rounds are not in increasing order"
        if problem is not None:
            raise RecordError(_malformed(path, f"rounds[{i}]: {problem}"))
        out.append(Handed(round=e["round"], file=e["file"], sha256=e[SHA256], bytes=e["bytes"]))
    return out


def _entry_problem(e: object) -> str | None:
    if not isinstance(e, dict) or set(e) != {"round", "file", SHA256, "bytes"}:
        return "not an object with fields round, file, sha256 and bytes"
    r, size = e["round"], e["bytes"]
    if type(r) is not int or not 0 <= r <= MAX_ROUND:
        return f"round is not a whole number from 0 to {MAX_ROUND}"
    if e["file"] != global_name(r):
        return f"file is not {global_name(r)}"
    if not isinstance(e[SHA256], str) or not _SHA256.fullmatch(e[SHA256]):
        return "sha256 is not 64 lowercase hex digits"
    if type(size) is not int or not 0 < size <= MAX_THETA_BYTES:
        return f"bytes is not a whole number from 1 to {MAX_THETA_BYTES}"
    return None


def _malformed(path: Path, why: str) -> str:
    return (
        f"{path}: not a record of the rounds handed to the run ({why}); the sync tick writes it, and writes "
        f"nothing over one that does not read. Fix: remove {path} (the next tick hands the newest verified "
        "round over again)"
    )

"""The staging wire protocol, and the pipe plumbing under it.

Each message is a 4-byte big-endian header length, a JSON header, then `n` raw bytes if the header says so
(a 'put' request, a 'get' reply). Invariant: a message is written whole or not at all by one `send` call
(one write, so BufferedWriter's lock keeps replies from several threads whole), and a reader takes exactly
its bytes (`read_exact`, `recv`), so the stream stays in step for the next message. Both ends use these
functions: the agent (hpcscale/xsite/agent.py) and the local side (hpcscale/xsite/stage.py, channel.py).

The other end may be anything (a partner site runs its own `python3`): every frame read is bounded before a
byte of it is buffered. `recv` refuses, as WireError, a header longer than the reader's limit (HEADER_MAX for
a reply, REQUEST_MAX for the agent's requests, more only where the request says how much comes back: a
plan's entry count), text that is not UTF-8, JSON that is invalid, nested too deeply (the parser's
RecursionError), holds NaN, Infinity, a float that overflows or an integer of more than INT_DIGITS digits,
and anything but a JSON object; it reads in CHUNK-sized pieces, so memory follows what actually arrived, not
what a length prefix claims. What each field of an object must be is the reader's business (channel.py,
stage.py on the local side; agent.py on the other).
"""

import json
import math
import os
import re
import struct
import threading
import time

from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import blocks

HEADER_MAX = 1 << 20  # bytes of a reply header (hello, ready, acks, get replies, errors): all small
REQUEST_MAX = (1 << 31) - 1  # bytes of a request header: a plan's entries, a commit's manifest (at most 1 GiB)
CHUNK = 1 << 20  # the most read at once while a frame's bytes come in
INT_DIGITS = 40  # the longest integer a header may hold (every count, size and time fits in 20 digits)
_LONG_INT = re.compile(r"\d{" + str(INT_DIGITS + 1) + "}")


class WireError(StageError):
    """A frame that breaks the protocol (too long, not JSON, not an object): the stream is out of step."""

    def __init__(self, message):
        super().__init__(message, "runtime")


def send(out, header, payload=b""):
    h = json.dumps(header, separators=(",", ":")).encode()
    out.write(struct.pack(">I", len(h)) + h)
    if payload:
        out.write(payload)


def _take(inp, n):
    """Exactly n bytes, read CHUNK at a time (never a buffer of n allocated ahead of the bytes), as a bytearray
    or, where one read brought them all, what that read returned."""
    if n == 0:
        return b""
    data = inp.read(min(n, CHUNK))
    if len(data) == n:
        return data
    buf = bytearray(data)
    while len(buf) < n:
        more = inp.read(min(n - len(buf), CHUNK))
        if not more:
            raise EOFError(f"the stream ended {n - len(buf)} bytes short")
        buf += more
    return buf


def read_exact(inp, n):
    """Exactly n bytes, as a bytes object of its own."""
    return bytes(_take(inp, n))


def _float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _int(text):
    if len(text.lstrip("-")) > INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _constant(name):
    raise ValueError(f"{name} is not a JSON value")


def parse_header(data):
    """A header's bytes as a dict, or WireError saying what is wrong with them (the bounds above)."""
    try:
        text = (data if isinstance(data, (bytes, bytearray)) else bytes(data)).decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(f"a header that is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        if _LONG_INT.search(text) is None:  # the common case at the C parser's speed; one hook, on floats only
            doc = json.loads(text, parse_float=_float, parse_constant=_constant)
        else:  # a run of digits, in a string or a number: only a number that long is refused
            doc = json.loads(text, parse_float=_float, parse_int=_int, parse_constant=_constant)
    except RecursionError:
        raise WireError("a header nested too deeply") from None
    except ValueError as e:  # json.JSONDecodeError, the hooks' refusals, a number Python will not convert
        raise WireError(f"a header that is not valid JSON ({str(e)[:200]})") from None
    if type(doc) is not dict:
        raise WireError(f"a header that is a JSON {type(doc).__name__}, not an object")
    return doc


def recv(inp, max_header=HEADER_MAX):
    """The next message's header (a dict); EOFError at the end of the stream; WireError for a frame over
    `max_header` bytes or not a bounded JSON object."""
    raw = inp.read(4)
    if not raw:
        raise EOFError("the stream ended")
    if len(raw) != 4:
        raw = bytes(raw) + read_exact(inp, 4 - len(raw))
    (n,) = struct.unpack(">I", raw)
    if n > max_header:
        raise WireError(f"a header of {n} bytes, over the limit of {max_header}")
    return parse_header(_take(inp, n))


class Input:
    """A read buffer over a pipe that calls `before_block` (flush the replies) before it waits for input.

    read() returns views of one reused buffer (no allocation per read): use the bytes before the next read."""

    def __init__(self, fd, before_block, size=1 << 20):
        self.fd = fd
        self.before_block = before_block
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pos = self.end = 0
        self.waiting_since = None  # monotonic time a read began waiting for the other side; None: not waiting

    def read(self, n):
        """Up to n bytes (fewer if fewer are buffered); empty at the end of the stream."""
        if self.pos >= self.end:
            self.before_block()
            self.waiting_since = time.monotonic()
            try:
                self.end = os.readv(self.fd, [self.buf])
            finally:
                self.waiting_since = None
            self.pos = 0
            if not self.end:
                return b""
        start = self.pos
        self.pos = min(self.end, start + n)
        return self.view[start : self.pos]


class TokenBucket:
    """A bandwidth limit shared by threads: take(n) sleeps until n bytes fit under `rate` bytes/s."""

    def __init__(self, rate):
        self.rate = float(rate)
        self.lock = threading.Lock()
        self.t = time.monotonic()
        self.debt = 0.0

    def take(self, n):
        with self.lock:
            now = time.monotonic()
            self.debt = max(0.0, self.debt - (now - self.t) * self.rate) + n
            self.t = now
            wait = self.debt / self.rate - 0.05  # allow a 50 ms burst
        if wait > 0:
            time.sleep(wait)


def pump(fd, offset, size, write, bucket=None, on_bytes=None):
    """Bytes [offset, size) of fd to `write`, under `bucket`'s rate, each block counted by `on_bytes`; returns
    where it stopped (short of size if the file shrank)."""
    pos = offset
    for data in blocks(fd, offset, size):
        if bucket is not None:
            bucket.take(len(data))
        write(data)
        pos += len(data)
        if on_bytes is not None:
            on_bytes(len(data))
    return pos


def stream_file(fd, offset, size, out, bucket=None):
    """Send bytes [offset, size) of fd to out."""
    pos = pump(fd, offset, size, out.write, bucket)
    if pos < size:
        raise StageError(f"file shrank while being sent ({pos} of {size} bytes)", "runtime")


F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named there only from Python 3.10


def pipe_size(fd):
    """A pipe's buffer size in bytes (F_GETPIPE_SZ); 4096, the least a pipe holds, where it cannot be read."""
    try:
        import fcntl

        return fcntl.fcntl(fd, F_SETPIPE_SZ + 1)  # F_GETPIPE_SZ
    except (OSError, ImportError):
        return 4096


def widen_pipe(fd, size=1 << 20):
    """Grow a pipe's buffer from 64 KiB (up to /proc/sys/fs/pipe-max-size): fewer, larger hand-offs between
    this process and ssh. Not a pipe, or not allowed: nothing changes."""
    try:
        import fcntl

        fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except (OSError, ImportError):
        pass

"""The staging wire protocol, and the pipe plumbing under it.

Each message is a 4-byte big-endian header length, a JSON header, then `n` raw bytes if the header says so
(a 'put' request, a 'get' reply). Invariant: a message is written whole or not at all by one `send` call
(one write, so BufferedWriter's lock keeps replies from several threads whole), and a reader takes exactly
its bytes (`read_exact`, `recv`), so the stream stays in step for the next message. Both ends use these
functions: the agent (hpcscale/xsite/agent.py) and the local side (hpcscale/xsite/stage.py, channel.py).
"""

import json
import os
import struct
import threading
import time

from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import blocks


def send(out, header, payload=b""):
    h = json.dumps(header, separators=(",", ":")).encode()
    out.write(struct.pack(">I", len(h)) + h)
    if payload:
        out.write(payload)


def read_exact(inp, n):
    """Exactly n bytes, as a bytes object of its own."""
    data = inp.read(n)
    if len(data) == n:
        return bytes(data)
    parts = [bytes(data)]
    got = len(data)
    while got < n:
        more = inp.read(n - got)
        if not more:
            raise EOFError(f"the stream ended {n - got} bytes short")
        parts.append(bytes(more))
        got += len(more)
    return b"".join(parts)


def recv(inp):
    raw = inp.read(4)
    if not raw:
        raise EOFError("the stream ended")
    if len(raw) != 4:
        raw = bytes(raw) + read_exact(inp, 4 - len(raw))
    (n,) = struct.unpack(">I", raw)
    return json.loads(read_exact(inp, n))


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

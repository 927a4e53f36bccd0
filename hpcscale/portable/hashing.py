"""Hash algorithms of manifests and staging, and reading a file's bytes in blocks to feed them.

The one owner of the algorithm names: a manifest records one of HASH_ALGORITHMS, and every hash hpcscale
computes for a manifest or a transfer comes from `hasher` here, at both ends of a transfer. sha256 is in the
standard library; xxh128 (xxHash3 128-bit, hex) and blake3 need their modules, which are looked up only when
first asked for, so that a site without them can still stage sha256 manifests.
"""

import os
import sys
import threading

from hpcscale.portable.errors import StageError

XXH128 = "xxh128"  # xxHash3, 128-bit (xxhash.xxh3_128): the default
SHA256 = "sha256"
BLAKE3 = "blake3"
HASH_ALGORITHMS = (XXH128, SHA256, BLAKE3)
HEX_DIGITS = {XXH128: 32, SHA256: 64, BLAKE3: 64}  # the length of each algorithm's hex digest
_HEX = "0123456789abcdef"

BLOCK = 4 << 20
SMALL = 256 << 10  # below this, one pread of the whole rest: no buffer to fill

_site_lock = threading.Lock()
_site_done = []


def _site():
    """The agent runs under `python3 -S` (site-packages processing is a good part of an interpreter's start, and
    a no-op rerun needs nothing from it); the first time a third-party module is needed, load the site now.
    Under a lock, and marked done only after site.main() returns: the writer threads ask at the same time, and
    'site' is in sys.modules before its paths are."""
    if _site_done or not sys.flags.no_site:
        return
    with _site_lock:
        if not _site_done:
            import site

            site.main()
            _site_done.append(True)


def _unknown(algorithm):
    return StageError(f"unknown hash algorithm '{algorithm}' (known: {', '.join(HASH_ALGORITHMS)})", "input")


def check_algorithm(algorithm):
    """StageError('input') unless `algorithm` is one of HASH_ALGORITHMS (its module is not looked for)."""
    if algorithm not in HASH_ALGORITHMS:
        raise _unknown(algorithm)


def check_digest(algorithm, digest):
    """None if `digest` is a lowercase hex digest of `algorithm`'s length, else why not. A digest names part
    files (hpcscale.portable.paths.part_name): anything else in it could reach a path."""
    if type(digest) is not str or len(digest) != HEX_DIGITS.get(algorithm, -1) or digest.strip(_HEX):
        shown = repr(digest)[:80]
        return f"hash {shown} is not {HEX_DIGITS.get(algorithm, '?')} lowercase hex digits ({algorithm})"
    return None


def hasher(algorithm):
    """A new hash object (update/hexdigest) for a manifest's algorithm name."""
    if algorithm == XXH128:
        _site()
        try:
            import xxhash
        except ImportError:
            raise StageError("hash algorithm xxh128 needs the xxhash module (pip install xxhash)", "input") from None
        return xxhash.xxh3_128()
    if algorithm == SHA256:
        import hashlib

        return hashlib.sha256()
    if algorithm == BLAKE3:
        _site()
        try:
            import blake3
        except ImportError:
            raise StageError("hash algorithm blake3 needs the blake3 module (pip install blake3)", "input") from None
        return blake3.blake3()
    raise _unknown(algorithm)


_tls = threading.local()


def blocks(fd, start=0, end=None):
    """The bytes of fd from `start` to `end` (EOF if None), as views of one reused per-thread buffer (a new
    4 MiB buffer per file would cost more than reading a small file)."""
    if end is None:
        end = os.fstat(fd).st_size
    if end - start <= SMALL:
        data = os.pread(fd, end - start, start)
        if data:
            yield data
        return
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(BLOCK)
    view = memoryview(buf)
    pos = start
    while pos < end:
        n = os.preadv(fd, [view[: min(BLOCK, end - pos)]], pos)
        if n == 0:
            return
        yield view[:n]
        pos += n


def hash_fd(fd, algorithm, limit=None, on_bytes=None):
    """(hex digest, bytes hashed) of the first `limit` bytes (all, if None) of an open file."""
    h = hasher(algorithm)
    n = 0
    for block in blocks(fd, 0, limit):
        h.update(block)
        n += len(block)
        if on_bytes is not None:
            on_bytes(len(block))
    return h.hexdigest(), n

"""The manifest's path rules, and the names staging gives its own files at a destination.

Every path a manifest lists is relative, '/'-separated, in normal form and inside its root: `check_relpath`
is the one rule, applied by the manifest reader (hpcscale/data/manifest.py), by both ends of a transfer and
by `manifest verify`; `within` is the one test that a resolved path stays under its root. A manifest lists
no staging state: STATE_DIR and part files (`.NAME.HASH16` + PART_SUFFIX) are what `hpcscale stage` leaves
at a destination (docs/staging.md): a manifest may not list them (`hpcscale manifest build` reports them as
not listed), so a listed file can never overwrite the record or another file's part.

`check_entry` is the one rule for a whole file entry as it crosses the wire ([path, size, mtime_ns, hash,
mode]): every field that reaches a path (path, hash) or a system call (size, mtime_ns, mode) is checked on
both ends, because the remote end cannot trust what arrives any more than the local one trusts a manifest.
"""

import os

from hpcscale.portable.hashing import HEX_DIGITS, check_digest

STATE_DIR = ".hpcscale-stage"  # at a destination root: the record of what was verified there, and journals
RECORD = "verified.json"  # in STATE_DIR
PART_SUFFIX = ".hpcscale-part"  # a file in transit: `.NAME.HASH16.hpcscale-part` beside NAME
NAME_MAX, PATH_MAX = 255, 4095  # bytes of one name and of a whole path on every Linux filesystem
INT64 = 1 << 63  # sizes and times are signed 64-bit in every system call they reach
MODE_BITS = 0o777  # the permission bits a manifest records; setuid, setgid and sticky are never carried
_HEX = frozenset("0123456789abcdef")


def is_part_name(name):
    """Whether a file name (no '/') has the form of a part file: `.NAME.HASH16.hpcscale-part`."""
    if not name.endswith(PART_SUFFIX) or name[0] != ".":
        return False
    stem = name[: -len(PART_SUFFIX)]
    return len(stem) > 18 and stem[-17] == "." and _HEX.issuperset(stem[-16:])


def check_relpath(path):
    """None if `path` is a safe relative path ('/'-separated, normal form, inside its root), else why not.
    Substring tests rather than a split: this runs for every file of every plan."""
    if not isinstance(path, str) or not path:
        return "path must be a non-empty string"
    if "\\" in path or "\x00" in path:
        return f"path '{path}' contains a backslash or NUL"
    if path[0] == "/":
        return f"path '{path}' is absolute"
    wrapped = "/" + path + "/"
    if "/../" in wrapped:
        return f"path '{path}' contains '..'"
    if "//" in wrapped or "/./" in wrapped:
        return f"path '{path}' is not in normal form"
    if len(path) > NAME_MAX or not path.isascii():
        try:
            data = path.encode("utf-8")
        except UnicodeEncodeError:
            return f"path {path!r} is not valid UTF-8 (a lone surrogate)"
        if len(data) > NAME_MAX and (len(data) > PATH_MAX or any(len(c) > NAME_MAX for c in data.split(b"/"))):
            return f"path '{path[:60]}...' is too long ({NAME_MAX} bytes a name, {PATH_MAX} in all)"
    if path == STATE_DIR or path.startswith(STATE_DIR + "/"):
        return f"path '{path}' is hpcscale stage's own state ({STATE_DIR}/ at the root)"
    if path.endswith(PART_SUFFIX) and is_part_name(path.rpartition("/")[2]):
        return f"path '{path}' has the form of a part file of a transfer in progress"
    return None


def check_size(size):
    if type(size) is not int or not 0 <= size < INT64:
        return f"size {str(size)[:40]} is not an integer from 0 to 2**63-1"
    return None


def check_mtime(mtime_ns):
    if type(mtime_ns) is not int or not -INT64 <= mtime_ns < INT64:
        return f"mtime_ns {str(mtime_ns)[:40]} is not an integer from -2**63 to 2**63-1"
    return None


def check_mode(mode):
    if mode is not None and (type(mode) is not int or not 0 <= mode <= MODE_BITS):
        return f"mode {str(mode)[:40]} is not permission bits from 0 to 0o777 (511)"
    return None


def check_dir_entry(entry):
    """None if `entry` ([path, mode]: a directory the manifest lists, with its permission bits) is safe."""
    if type(entry) not in (list, tuple) or len(entry) != 2:
        return f"directory entry {str(entry)[:80]} is not [path, mode]"
    path, mode = entry
    problem = check_relpath(path)
    if problem is None and (mode is None or check_mode(mode)):
        problem = f"'{path}': {check_mode(mode) or 'a directory needs its mode'}"
    return problem


def check_entry(entry, algorithm):
    """None if `entry` ([path, size, mtime_ns, hash, mode], mode may be None) is safe to act on, else why not,
    naming the path. This runs for every file of every plan (a no-op rerun of a million files): a valid entry
    passes one expression; the checks one by one run only to word a refusal, and say the same."""
    if (
        type(entry) in (list, tuple)
        and len(entry) == 5
        and type(entry[1]) is int
        and 0 <= entry[1] < INT64
        and type(entry[2]) is int
        and -INT64 <= entry[2] < INT64
        and type(entry[3]) is str
        and len(entry[3]) == HEX_DIGITS.get(algorithm, -1)
        and _HEX.issuperset(entry[3])
        and (entry[4] is None or (type(entry[4]) is int and 0 <= entry[4] <= MODE_BITS))
        and check_relpath(entry[0]) is None
    ):
        return None
    return _entry_problem(entry, algorithm)


def _entry_problem(entry, algorithm):
    """Why `entry` is refused, in words (check_entry's slow path; None if it is not)."""
    if type(entry) not in (list, tuple) or len(entry) != 5:
        return f"file entry {str(entry)[:80]} is not [path, size, mtime_ns, hash, mode]"
    path, size, mtime_ns, digest, mode = entry
    problem = check_relpath(path)
    if problem is None:
        problem = check_size(size) or check_mtime(mtime_ns) or check_digest(algorithm, digest) or check_mode(mode)
        if problem is not None:
            problem = f"'{path}': {problem}"
    return problem


def under_a_file(files, dirs=()):
    """(path, file) for the first listed path that lies under a listed file ('Data.bin/x' beside 'Data.bin'), or
    None. No filesystem can hold both: a stage would fail at the copy, where retrying cannot help, so a
    manifest that lists both is refused when it is read."""
    listed = set(files)
    for path in list(files) + list(dirs):
        parts = path.split("/")
        for n in range(1, len(parts)):
            parent = "/".join(parts[:n])
            if parent in listed:
                return path, parent
    return None


def within(path, root):
    """Whether the resolved `path` is `root` or lies under it."""
    return path == root or path.startswith(root + os.sep)


def part_name(part_prefix, digest):
    """The part file of a file in transit, beside NAME in its directory: `part_prefix` is `.NAME` (hpcscale.
    portable.sink.Writer opens it relative to the directory's descriptor); the first 16 hex digits of the
    expected hash tell parts of different contents apart."""
    return f"{part_prefix}.{digest[:16]}{PART_SUFFIX}"

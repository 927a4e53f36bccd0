"""The journal of a stage: one line for each file it put in place at a destination, before the stage commits.

A journal is `.hpcscale-stage/journal-TOKEN-RANDOM.jsonl` (TOKEN: the destination lock's token of the stage
that wrote it), made fresh (O_EXCL, never through a symlink), 0600, appended to and flushed as files are named,
so that a killed stage loses no line of a file already in place. Each line is one JSON array:

    [algorithm, path, [size, mtime_ns, ctime_ns, inode, hash]]            (older stages)
    [algorithm, path, [size, mtime_ns, ctime_ns, inode, hash], [dev, ino]]  (the directory it was named in)

The stat fields are the fstat of the file's own descriptor once named, never a stat of the name. The commit
merges the journals into `.hpcscale-stage/verified.json` (hpcscale.portable.sink) and removes them. Readers
take every whole line of that shape and skip any other (a line a kill cut short, a hand-edited one): a journal
is read only after the Sink judged, on the descriptor it read, that no one else could have written it.

Standard library only: this module runs in the staging agent at the other site (python 3.8 and later).
"""

import json
import os
import threading

PREFIX = "journal-"
SUFFIX = ".jsonl"
MODE = 0o600


def is_journal(name):
    """Whether a name in the state directory is a journal's."""
    return name.startswith(PREFIX) and name.endswith(SUFFIX)


def own_prefix(token):
    """The name prefix of the journals the stage holding lock `token` writes (None: no token, none of its own)."""
    return f"{PREFIX}{token}-" if token else None


class Journal:
    """The journal this stage appends to: made in `state_fd` on the first line; safe to use from many threads."""

    def __init__(self, state_fd, token, algorithm):
        self._state_fd = state_fd
        self._token = token
        self._algorithm = algorithm
        self._file = None
        self._lock = threading.Lock()

    def add(self, path, st, digest, where=None):
        """One file placed: `st` the fstat of its descriptor after it was named, `where` the (st_dev, st_ino) of
        the directory it was named in (None: not known)."""
        rec = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, digest]
        line = [self._algorithm, path, rec] if where is None else [self._algorithm, path, rec, list(where)]
        text = json.dumps(line) + "\n"
        with self._lock:
            if self._file is None:
                name = f"{PREFIX}{self._token}-{os.urandom(8).hex()}{SUFFIX}"
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND
                self._file = os.fdopen(os.open(name, flags, MODE, dir_fd=self._state_fd), "a")
            self._file.write(text)

    def flush(self):
        """Push the lines written so far to the OS."""
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self):
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


_decode = json.JSONDecoder().raw_decode


def values(text):
    """The JSON value of each whole line of a journal, skipping any other line (one a kill cut short). One
    decoder call a line, no wrapper: json.loads per line costs half again as much."""
    out = []
    i, n = 0, len(text)
    while i < n:
        end = text.find("\n", i)
        if end < 0:
            end = n
        try:
            value, stop = _decode(text, i)
            if stop == end:  # the value is this line, all of it, and no more
                out.append(value)
        except (ValueError, RecursionError):
            pass
        i = end + 1
    return out


def entries(text, algorithm):
    """(path, record, where) for each line of journal `text` written with hash `algorithm`: record as written
    (the reader compares it with a stat before it vouches for anything), where the directory's [dev, ino] or
    None. Lines of another shape or algorithm are skipped."""
    for line in values(text):
        if type(line) is not list or len(line) not in (3, 4):
            continue
        alg, path, rec = line[:3]
        if alg == algorithm and type(path) is str:
            yield path, rec, (line[3] if len(line) == 4 else None)

"""Whose files hpcscale honours, and what it prints from files others may write (the run directory's trust model).

A run directory usually lives on a shared filesystem, where a colleague with group write access (or anyone,
in a world-writable directory) can replace its files between two commands. Two rules follow.

Configuration that names programs, libraries or paths (RUN/job.yaml, RUN/site.yaml, the slurm.conf a site
names through `slurm.conf`, hpcscale's own record of what was submitted) is honoured only from a file that
- is a regular file, opened without following a symbolic link at its last component (O_NOFOLLOW) and without
  waiting on a FIFO (O_NONBLOCK), every check made with fstat on that same descriptor (nothing can be swapped
  between the check and the read);
- is owned by the invoking user or by root;
- is writable by neither its group nor others (mode & 0o022 == 0), root's files included; group write is
  allowed only where the group is the owner's user-private group (named as the owner, no other listed
  member: RHEL-like systems give each user one, with umask 002).
For a slurm.conf (hpcscale.slurm.client resolves a symlink first and hands Slurm the file it leads to) the
directory holding it must pass the same owner check and be writable by neither group nor others unless it is
sticky (like /tmp: nobody can then rename another's file away). Anything else is refused
with `UntrustedFile` (BadInput, exit 2) naming the file, its owner and mode, and the fix.

Text taken from a run directory (metrics, logs, job names, node names, Slurm's answers about its jobs) reaches
the terminal only through `clean` (control characters, escape sequences included, shown as visible escapes),
and where rich renders markup, through `clean_markup` (the same, then rich.markup.escape): a value can neither
move the cursor, retitle the terminal, nor turn into a link.
"""

from __future__ import annotations

import errno
import os
import pwd
import re
import stat
from pathlib import Path

from hpcscale.errors import BadInput

MAX_CONFIG_BYTES = 1 << 20  # a job spec or site config is a few KB (hpcscale.config.yamlsrc.MAX_BYTES)


class UntrustedFile(BadInput):
    """A file (or its directory) that someone other than the user or root could have written."""


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def trusted_owners() -> tuple[int, ...]:
    """The owners whose files are honoured: the invoking (effective) user and root."""
    return (os.geteuid(), 0)


def problem(st: os.stat_result, *, directory: bool = False) -> str | None:
    """Why a file (or directory) with this fstat must not be trusted; None when it may be."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by {_owner(st.st_uid)}, not by you ({_owner(me)}) or root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o020 and private_group(st):
        mode &= ~0o020  # the owner's own user-private group (umask 002 on RHEL-like systems): no one else
    if mode & 0o022 and not (directory and mode & stat.S_ISVTX):
        who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)
        return f"writable by {who} (mode {mode:04o})"
    return None


def private_group(st: os.stat_result) -> bool:
    """Whether the file's group is its owner's user-private group: a group named as the owner with no other
    member (the default on RHEL-like systems, whose umask 002 makes every file group-writable). Group write
    then lets no one else in. A gid or uid with no name, or a group with members, is not."""
    import grp

    if st.st_uid == 0:  # root's group may have members by primary gid that gr_mem does not list: never
        return False
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
        group = grp.getgrgid(st.st_gid)
    except KeyError:
        return False
    return group.gr_name == owner and set(group.gr_mem) <= {owner}


def _fix(path: Path, st: os.stat_result, *, directory: bool = False) -> str:
    me = os.geteuid()
    steps = []
    if st.st_uid not in (me, 0):
        if directory:
            steps.append("keep the file in a directory of yours or root's that no one else can write")
        else:
            steps.append(
                "read it first; only if you trust what it says, make it yours "
                f"(cp {path} {path}.mine && mv {path}.mine {path}, or chown it as root)"
            )
    mode = stat.S_IMODE(st.st_mode) & ~(0o020 if private_group(st) else 0)
    if mode & 0o022 and not (directory and mode & stat.S_ISVTX):
        steps.append(f"chmod go-w {path}" if directory else f"check what it says, then chmod go-w {path}")
    return "; then ".join(steps)


def refuse(path: Path, st: os.stat_result, why: str, *, what: str, directory: bool = False) -> UntrustedFile:
    mode = stat.S_IMODE(st.st_mode)
    fix = _fix(path, st, directory=directory)
    return UntrustedFile(
        f"{path}: refusing the {what}: {why} (owner {_owner(st.st_uid)}, mode {mode:04o}); hpcscale honours "
        "configuration only from files owned by you or root and writable by no one else"
        + (f". Fix: {fix}" if fix else "")
    )


def check_fd(fd: int, path: Path, *, what: str, directory: bool = False) -> os.stat_result:
    """fstat `fd` (opened from `path`) and refuse it unless it is a regular file (a directory with
    `directory`) that only the user or root can write."""
    st = os.fstat(fd)
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise UntrustedFile(f"{path}: refusing the {what}: not a {'directory' if directory else 'regular file'}")
    why = problem(st, directory=directory)
    if why is not None:
        raise refuse(path, st, why, what=what, directory=directory)
    return st


def _open(path: Path, flags: int, what: str) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such {what}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            try:
                target = f" (to {clean(os.readlink(path), limit=300)})"
            except OSError:
                target = ""
            raise UntrustedFile(
                f"{path}: refusing the {what}: a symbolic link{target}; hpcscale reads configuration only "
                "from the file itself. Fix: name (or copy) the file it leads to"
            ) from None
        raise BadInput(f"{path}: cannot read the {what} ({e.strerror})") from None


def read_trusted(path: str | Path, *, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a configuration file the user may rely on (the rules above), read once from the descriptor
    that was checked; at most `max_bytes` (BadInput over it)."""
    p = Path(path)
    fd = _open(p, os.O_RDONLY, what)
    try:
        st = check_fd(fd, p, what=what)
        if st.st_size > max_bytes:
            raise BadInput(f"{p}: {st.st_size} bytes, over the limit of {max_bytes} for a {what}")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise BadInput(f"{p}: over the limit of {max_bytes} bytes for a {what}")
        return b"".join(chunks)
    except OSError as e:
        raise BadInput(f"{p}: cannot read the {what} ({e.strerror})") from None
    finally:
        os.close(fd)


def check_trusted(path: str | Path, *, what: str, parent: bool = False, directory: bool = False) -> None:
    """Refuse `path` (UntrustedFile, exit 2) unless it is a file (a directory with `directory`) the rules above
    trust; with `parent`, its directory too (owned by the user or root, writable by no one else unless
    sticky). For files hpcscale hands to another program by name (SLURM_CONF): the parent check keeps anyone
    else from swapping the file after the check."""
    p = Path(path)
    fd = _open(p, os.O_RDONLY | (os.O_DIRECTORY if directory else 0), what)
    try:
        check_fd(fd, p, what=what, directory=directory)
    finally:
        os.close(fd)
    if parent:
        d = p.parent
        try:  # the directory itself, through any symlink: its owner and mode are what keep the file in place
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise BadInput(f"{d}: cannot open the directory of the {what} ({e.strerror})") from None
        try:
            check_fd(dfd, d, what=f"directory of the {what}", directory=True)
        finally:
            os.close(dfd)


# ---- text from files others may write, on its way to a terminal ---------------------------------------------
# What a terminal must not receive as it is: C0 and C1 controls (ESC, BEL, CR...; not tab and newline, handled
# apart), DEL, bidirectional and zero-width marks, line/paragraph separators, and lone surrogates (which cannot
# even be encoded for printing). One class for every printer (hpcscale.xsite.channel.shown uses it too).
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ud800-\udfff]")
MAX_SHOWN = 2000  # characters of one value shown; the rest is cut with an ellipsis


def clean(value: object, *, limit: int = MAX_SHOWN, newlines: bool = False) -> str:
    """`value` as text safe for a terminal: control characters (ESC, BEL, CR, ...; bidirectional overrides)
    become visible \\xNN / \\uNNNN escapes, tabs a space, newlines too unless `newlines`; cut to `limit`."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "…"
    text = text.replace("\t", " ")
    if not newlines:
        text = text.replace("\n", " ")
    return CONTROL.sub(_visible, text)


def _visible(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean_markup(value: object, *, limit: int = MAX_SHOWN) -> str:
    """`clean`, then escaped for rich markup: `[link=...]` in a value prints as those characters."""
    from rich.markup import escape

    return escape(clean(value, limit=limit))

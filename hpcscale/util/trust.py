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

Directories hpcscale keeps state in and later reads back as its own (a checkpoint tier's directory: what a
resume loads) are trusted by the same owner rule, and never taken over from someone who made them first:
- such a directory is made by this process with mkdir, which fails when the name exists (O_EXCL semantics),
  with a mode that no umask widens to group or other write (0700 on a node's own disk, 0755 on a shared tier);
  every directory from the shared place it sits in (a node-local scratch root, a site's checkpoint_root, a
  run directory others may write) down to it is made, or checked, that way (`private_dir`);
- one that already exists (a resume, another rank of the job first) is opened without following a symbolic
  link (O_NOFOLLOW|O_DIRECTORY) and accepted only if fstat on that descriptor says it is owned by the user or
  root and writable by neither its group nor others (group write only for the owner's user-private group, as
  above; a sticky bit does not help: others could still add entries); when its mode lets its group or others
  in, the directories in it (two levels: a step and its data) must pass the same test, by lstat;
- anything else is refused with `UntrustedFile` (exit 2 for a command; a job's ranks stop at start, every rank
  alike, with the line), naming the directory, its owner and mode, and the fix. Nothing in it is read, moved
  or deleted.
The shared place itself (`below`) is made if missing and refused when someone other than the user or root owns
it or a directory above it (up to the first root-owned sticky one, like /var/tmp), or when one of them is
writable by others and not sticky (`shared_place`): they could otherwise rename a checked directory away while
a job runs and put theirs in its place. Group write is allowed; a group member can still do that, and then a
drain refuses the step it finds (hpcscale.ckpt.nodelocal.drain_source compares its root digest with the one
this process saved) and the next start refuses the directory they made.

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


def problem(st: os.stat_result, *, directory: bool = False, acl: bool = False) -> str | None:
    """Why a file (or directory) with this fstat must not be trusted; None when it may be. `acl`: the file has a
    POSIX access ACL (`has_acl`), whose mask its group bits then are: group write may be a named user's, so
    the user-private-group exception does not apply."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by {_owner(st.st_uid)}, not by you ({_owner(me)}) or root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o020 and not acl and private_group(st):
        mode &= ~0o020  # the owner's own user-private group (umask 002 on RHEL-like systems): no one else
    if mode & 0o022 and not (directory and mode & stat.S_ISVTX):
        who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)
        return f"writable by {who} (mode {mode:04o})"
    return None


def has_acl(fd: int) -> bool:
    """Whether the open file `fd` carries a POSIX access ACL (beyond its mode bits): its group bits are then the
    ACL's mask, which a named user's or group's write entry sets."""
    try:
        os.getxattr(fd, "system.posix_acl_access")
    except OSError as e:  # unreadable otherwise: judged as if it had one (no private-group exception)
        return e.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP)
    return True


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


def _fix(path: Path, st: os.stat_result, *, directory: bool = False, acl: bool = False) -> str:
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
    mode = stat.S_IMODE(st.st_mode) & ~(0o020 if not acl and private_group(st) else 0)
    if mode & 0o022 and not (directory and mode & stat.S_ISVTX):
        chmod = f"setfacl -b {path} && chmod go-w {path}" if acl else f"chmod go-w {path}"
        steps.append(chmod if directory else f"check what it says, then {chmod}")
    return "; then ".join(steps)


def refuse(
    path: Path, st: os.stat_result, why: str, *, what: str, directory: bool = False, acl: bool = False
) -> UntrustedFile:
    mode = stat.S_IMODE(st.st_mode)
    fix = _fix(path, st, directory=directory, acl=acl)
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
    acl = has_acl(fd)
    why = problem(st, directory=directory, acl=acl)
    if why is not None:
        raise refuse(path, st, why + (" (through its ACL)" if acl else ""), what=what, directory=directory, acl=acl)
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


# ---- directories hpcscale keeps its own state in -------------------------------------------------------------
PRIVATE_DEPTH = 2  # levels checked inside a directory others may enter: a checkpoint step, then its data/


def private_dir(path: str | Path, *, what: str, mode: int = 0o700, below: str | Path | None = None) -> None:
    """Make `path` a directory only the user (or root) can write, or accept the one there only if it is one
    (the rules above; UntrustedFile otherwise). `below` is the shared place it sits in (default: its parent),
    made if missing and then held to `shared_place`'s rule (no one else may rename it away); each directory
    from there down to `path` is made with `mode` (mkdir failing on an existing name; set with fchmod, so
    whatever the umask) or checked on the descriptor it is opened as. Safe when several processes (every rank
    on a node) call it at once: one makes each directory, the others check it."""
    p = Path(path)
    base = Path(below) if below is not None else p.parent
    names = p.relative_to(base).parts
    if not names or ".." in names:
        raise ValueError(f"{p}: not a directory below {base}")
    if mode & 0o022:
        raise ValueError(f"mode {mode:04o}: a private directory is writable by no one else")
    try:
        os.makedirs(base, exist_ok=True)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise BadInput(f"{base}: cannot make or open the directory for the {what} ({e.strerror})") from None
    try:
        shared_place(base, fd, what=what)
        here = base
        for name in names:
            here = here / name
            made = False
            try:
                os.mkdir(name, mode, dir_fd=fd)
                made = True
            except FileExistsError:
                pass  # someone's: judged below, on the descriptor
            except OSError as e:
                raise BadInput(f"{here}: cannot make the {what} ({e.strerror})") from None
            inner = _open_dir(here, name, fd, what)
            os.close(fd)
            fd = inner
            st = check_dir_fd(fd, here, what=what)
            if made and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)  # the mode asked for, whatever the umask (it only ever narrows mkdir's)
        _check_inside(fd, p, what)
    finally:
        os.close(fd)


def shared_place(base: Path, fd: int, *, what: str) -> None:
    """Refuse (UntrustedFile) the place `base` (open as `fd`) a private directory is made in where someone else
    could rename what hpcscale makes there away and put their own in its place while a job runs: from `base`
    up to the first directory that is root's and sticky (like /tmp, /var/tmp) or to /, every directory must be
    the user's or root's and not writable by others unless sticky (the owner of a directory, and anyone who
    may write a directory that is not sticky, can rename what is in it). Group write is allowed: a project's
    shared directory, whose members are the colleagues the run is shared with; what they could put in place of
    a directory hpcscale made is theirs, refused at the next start, and a drain to the shared tier takes a
    node-local step only with the digest this job saved. Above a root-owned sticky directory the system's
    layout is not judged."""
    me = os.geteuid()
    here, st = Path(os.path.abspath(base)), os.fstat(fd)
    while True:
        mode = stat.S_IMODE(st.st_mode)
        sticky = bool(mode & stat.S_ISVTX)
        if st.st_uid not in (me, 0):
            why = f"owned by {_owner(st.st_uid)}, not by you ({_owner(me)}) or root"
        elif mode & 0o002 and not sticky:
            why = f"writable by others and not sticky (mode {mode:04o})"
        else:
            why = None
        if why is not None:
            raise UntrustedFile(
                f"{here}: refusing it as the place of the {what} ({base}): {why}; its owner or anyone could then "
                "rename what hpcscale makes in it away and put their own in its place while the job runs. Fix: "
                f"use a directory of yours (or root's) that others cannot write, or have {here}'s owner make it "
                f"sticky (chmod +t {here})"
            )
        if (sticky and st.st_uid == 0) or here.parent == here:
            return
        here = here.parent
        try:
            st = os.stat(here)
        except OSError as e:
            raise BadInput(f"{here}: cannot check the place of the {what} ({e.strerror})") from None


def check_private_dir(path: str | Path, *, what: str, reading: bool = False) -> None:
    """Accept the existing directory `path` leads to (through a symbolic link: a run's checkpoints/ linked to
    its directory under checkpoint_root) only as private_dir would accept it. `reading`: one hpcscale only
    reads and never wrote (another run's checkpoints, xsite.start_from): the refusal's fix says to copy it."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise BadInput(f"{p}: cannot open the {what} ({e.strerror})") from None
    try:
        check_dir_fd(fd, p, what=what, reading=reading)
        _check_inside(fd, p, what, reading=reading)
    finally:
        os.close(fd)


def _open_dir(path: Path, name: str, dir_fd: int, what: str) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a symbolic link (O_NOFOLLOW), or not a directory at all
            kind = "a symbolic link" if os.path.islink(path) else "not a directory"
            raise UntrustedFile(
                f"{path}: refusing the {what}: {kind}; hpcscale keeps it only in a real directory of its own. "
                f"Fix: remove {path} if it is not yours to keep (hpcscale then makes the directory)"
            ) from None
        raise BadInput(f"{path}: cannot open the {what} ({e.strerror})") from None


def check_dir_fd(fd: int, path: Path, *, what: str, sticky_ok: bool = False, reading: bool = False) -> os.stat_result:
    """fstat the directory `fd` (opened from `path`) and refuse it (UntrustedFile) unless it is the user's or
    root's and no one else can write it. `sticky_ok`: a sticky directory others may write (like /tmp) is
    accepted, for one hpcscale only writes into and never reads back (report -o): others can add names there
    but not replace or remove the user's files."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedFile(f"{path}: refusing the {what}: not a directory")
    acl = has_acl(fd)
    why = problem(st, directory=sticky_ok, acl=acl)  # by default no sticky exception: others could still add steps
    if why is not None:
        why += " (through its ACL)" if acl else ""
        raise refuse_dir(path, st, why, what=what, reading=reading)
    return st


def _check_inside(fd: int, path: Path, what: str, *, reading: bool = False) -> None:
    """The directories inside one that its group or others may enter: each must pass the same test, or its
    contents (a step's index and digest) could be replaced by whoever can write it."""
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o011:  # otherwise no one else gets in: what is inside is the owner's
        _check_level(fd, path, what, PRIVATE_DEPTH, reading)


def _check_level(fd: int, path: Path, what: str, depth: int, reading: bool = False) -> None:
    with os.scandir(fd) as entries:
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile (another rank's retention)
        if (why := problem(st)) is not None:
            raise refuse_dir(path / name, st, why, what=f"directory in the {what}", reading=reading)
        try:  # its ACL, and the level below, on a descriptor of the directory itself
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            continue
        try:
            st = os.fstat(inner)
            if has_acl(inner) and (why := problem(st, acl=True)) is not None:
                why += " (through its ACL)"
                raise refuse_dir(path / name, st, why, what=f"directory in the {what}", reading=reading)
            if depth > 1:
                _check_level(inner, path / name, what, depth - 1, reading)
        finally:
            os.close(inner)


def refuse_dir(path: Path, st: os.stat_result, why: str, *, what: str, reading: bool = False) -> UntrustedFile:
    """The refusal of a directory hpcscale would keep its state in (or, `reading`, load from), with the fix."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid in (os.geteuid(), 0):
        fix = f"check what is in it, then chmod -R go-w {path}"
    elif reading:
        fix = "copy it into a directory of yours that no one else can write (cp -r, then chmod -R go-w) and name that"
    else:
        fix = (
            f"someone else made {path} first, so whatever is in it is theirs: have its owner (or root) remove "
            "it, or use another directory; hpcscale then makes it anew, as yours"
        )
    if reading:
        rule = (
            "hpcscale loads checkpoints it did not write only from directories that you (or root) own and no one "
            "else can write: whoever can write there chooses what is loaded. Nothing in it was read"
        )
    else:
        rule = (
            "hpcscale writes its state only into directories that you (or root) made and no one else can write. "
            "Nothing in it was read or changed"
        )
    return UntrustedFile(
        f"{path}: refusing the {what}: {why} (owner {_owner(st.st_uid)}, mode {mode:04o}); {rule}. Fix: {fix}"
    )


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

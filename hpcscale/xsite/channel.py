"""Endpoints (`/path`, `ssh://[user@]host[:port]/path`) and the ssh stream to a staging agent.

Kept light on imports: `hpcscale stage` starts ssh from here before it loads the rest of itself (even click:
see `prelaunch`), so the connection (a third of a second on loopback, more across sites) comes up while the
command loads and reads its manifest.

The other end is another site's, and could run anything in place of the agent: every byte it sends is
hostile input. So (docs/staging.md, the trust model):
- every frame is read under hpcscale.portable.wire's bounds, every reply type-checked against what its
  request expects (`Channel.call`, `check_error`, and hpcscale.xsite.stage's checks of plans, acks and get
  replies); a violation is a RuntimeFailure (exit 1) naming the remote and what was wrong, ssh stopped
  (`Channel.violation`);
- every wait for the remote is watched (`Channel._watch`): nothing from it for `stall_timeout()` seconds
  (STALL_S, or the environment's HPCSCALE_STAGE_TIMEOUT) while we wait on it, in either direction, stops
  ssh and fails the stage (exit 1) naming the request it stalled in. The agent sends {"busy": OP} while it
  works on a long plan, flush or commit, so a slow plan is not a stall;
- every string from the remote is passed through `shown` before it can reach a terminal (no control
  characters, escapes or bidirectional overrides);
- an ssh host or user that begins with '-' or holds whitespace or control characters is refused when the
  endpoint is parsed (exit 2), and `--` ends ssh's options before the host.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import namedtuple
from collections.abc import Sequence

from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.portable.errors import KINDS
from hpcscale.util.trust import CONTROL
from hpcscale.xsite import DEFAULT_REMOTE_PYTHON, DEFAULT_SSH
from hpcscale.xsite.bootstrap import BOOT, agent_blobs

STALL_S = 600.0  # seconds without a byte either way while we wait on the remote: it is stalled (ssh is stopped)
TIMEOUT_ENV = "HPCSCALE_STAGE_TIMEOUT"  # overrides STALL_S (seconds, > 0): for very slow links, and for tests
REPLY_MAX = 1 << 20  # bytes of a reply header other than a plan's (hpcscale.portable.wire.HEADER_MAX)
PLAN_REPLY_BYTES = 24  # a plan reply's bytes per entry, at most: a status is -1 or an offset (up to 19 digits)
STDERR_MAX = 1 << 20  # ssh's stderr kept in memory at most (a remote can write to it without end)
READ_MAX = 4 << 20  # the most one read of ssh's output asks for (hpcscale.portable.hashing.BLOCK)


def stall_timeout() -> float:
    """STALL_S, or the environment's HPCSCALE_STAGE_TIMEOUT: the one place the stall timeout is read."""
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return STALL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise BadInput(f"{TIMEOUT_ENV}: '{shown(text, 40)}' is not a number of seconds > 0")
    return value


# C0 and C1 controls but newline and tab, DEL, bidirectional and zero-width formatting, line and paragraph
# separators, lone surrogates (JSON can carry them; a terminal cannot print them)
_UNSAFE = CONTROL  # hpcscale.util.trust: one class of characters no printer passes on
_UNSAFE_LINE = re.compile("[\n\t]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def shown(text: object, limit: int = 1000, lines: bool = False) -> str:
    """Text from the remote, safe to print: control characters, escape sequences, bidirectional overrides and
    lone surrogates written as visible escapes (\\x1b), newlines and tabs too unless `lines`; at most `limit`
    characters. Rich markup is left as it is: no remote text is printed through rich's markup."""
    text = text if type(text) is str else repr(text)
    if len(text) > limit:
        text = text[:limit] + "..."
    text = _UNSAFE.sub(_escape, text)
    return text if lines else _UNSAFE_LINE.sub(_escape, text)


class ProtocolError(Exception):
    """What a message from the remote did wrong; Channel.violation makes it the stage's error."""


def _wire():
    """The wire protocol (hpcscale.portable.wire), imported on first use: not needed to start ssh."""
    from hpcscale.portable import wire

    return wire


def error_for(message: str, kind: str) -> Exception:
    """The hpcscale error (and so the exit code) for an agent error kind."""
    return {"input": BadInput, "verify": VerificationFailure}.get(kind, RuntimeFailure)(message)


def check_error(msg: dict) -> tuple[str, str]:
    """An error reply's (message, kind): the message a string (returned made safe to print, `shown`), the kind
    one of hpcscale.portable.errors.KINDS; ProtocolError otherwise."""
    text, kind = msg.get("error"), msg.get("kind", "runtime")
    if type(text) is not str:
        raise ProtocolError(f"an error reply whose message is a {type(text).__name__}, not a string")
    if type(kind) is not str or kind not in KINDS:
        raise ProtocolError(f"an error reply of unknown kind {shown(repr(kind), 40)}")
    return shown(text), kind


def _fields(msg: dict, what: str, **want: tuple) -> None:
    """ProtocolError unless each named field of `msg` is of one of its types (bool is not an int here)."""
    for key, types in want.items():
        value = msg.get(key)
        if type(value) not in types:
            raise ProtocolError(f"{what} whose '{key}' is {shown(repr(value), 40)}")


def check_reply(op: str, msg: dict) -> None:
    """ProtocolError unless `msg` is the success reply an agent sends to `op` (plan: hpcscale.xsite.stage)."""
    if op == "hello":
        if type(msg.get("hello")) is not int or msg["hello"] != 1:
            raise ProtocolError("a first message that is not the staging agent's hello")
        _fields(msg, "a hello", python=(str, type(None)))
    elif op == "init":
        if msg.get("ready") is not True:
            raise ProtocolError("an init reply without ready: true")
        _fields(msg, "an init reply", root=(str,))
    elif op == "commit" and msg.get("committed") is not True:
        raise ProtocolError("a commit reply without committed: true")


def _host_problem(name: str) -> str | None:
    """Why an ssh host or user name cannot be passed to ssh, or None."""
    if name.startswith("-"):
        return "begins with '-' (ssh would take it for an option)"
    if any(c.isspace() or ord(c) < 32 or 127 <= ord(c) < 160 for c in name):
        return "holds whitespace or a control character"
    return None


class Endpoint(namedtuple("Endpoint", "kind path host user port", defaults=("", "", None))):
    """kind "local" or "ssh"; host, user and port (None: ssh's default) for ssh. A named tuple, not a dataclass:
    this module loads before ssh starts, and dataclasses costs milliseconds to import."""

    __slots__ = ()

    def __str__(self) -> str:
        if self.kind == "local":
            return self.path
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"ssh://{user}{self.host}{port}{self.path}"


def parse_endpoint(text: str, what: str = "endpoint") -> Endpoint:
    """A local path, or ssh://[user@]host[:port]/path (a path starting /~/ is relative to the remote home)."""
    if text.startswith("ssh://"):
        from urllib.parse import unquote, urlsplit

        authority = text[6:].partition("/")[0]  # raw: urlsplit drops tabs and newlines, and lowercases
        user, _, host = authority.rpartition("@")
        for name, value in (("host", host), ("user", user)):
            why = _host_problem(value)
            if why:
                raise BadInput(f"{what}: '{shown(text)}': the {name} '{shown(value)}' {why}")
        try:
            u = urlsplit(text)  # ValueError for a bracketed host that is not an IPv6 address ('ssh://[::1/p')
            port = u.port
        except ValueError as e:
            raise BadInput(f"{what}: '{shown(text)}': not a valid ssh URL ({shown(e, 200)})") from None
        if not u.hostname or not u.path or u.path == "/":
            raise BadInput(f"{what}: '{shown(text)}': expected ssh://[user@]host[:port]/path")
        path = unquote(u.path)
        if path.startswith("/~"):
            path = path[1:]
        return Endpoint("ssh", path, u.hostname, u.username or "", port)
    if "://" in text:
        raise BadInput(f"{what}: '{text}': unknown scheme (use a local path or ssh://host/path)")
    return Endpoint("local", os.path.abspath(os.path.expanduser(text)))


class _Reader:
    """ssh's stdout as the wire reads it: each read takes at most READ_MAX bytes, in one system call at most,
    and is stamped for the channel's watchdog while it waits."""

    __slots__ = ("ch", "f")

    def __init__(self, f, ch: Channel):
        self.f, self.ch = f, ch

    def read(self, n: int) -> bytes:
        ch = self.ch
        ch.reading = time.monotonic()
        try:
            return self.f.read1(min(n, READ_MAX))
        finally:
            ch.progress = time.monotonic()
            ch.reading = 0.0

    def close(self) -> None:
        self.f.close()

    def fileno(self) -> int:
        return self.f.fileno()


class _Writer:
    """ssh's stdin: writes of at most READ_MAX bytes each into its buffer, each stamped for the watchdog while
    it waits (a remote that stops reading fills the pipe, and a write then blocks)."""

    __slots__ = ("ch", "f")

    def __init__(self, f, ch: Channel):
        self.f, self.ch = f, ch

    def _timed(self, fn, *args) -> None:
        ch = self.ch
        ch.writing = time.monotonic()
        try:
            fn(*args)
        finally:
            ch.progress = time.monotonic()
            ch.writing = 0.0

    def write(self, data) -> None:
        if len(data) <= READ_MAX:
            self._timed(self.f.write, data)
            return
        view = memoryview(data)
        for i in range(0, len(view), READ_MAX):
            self._timed(self.f.write, view[i : i + READ_MAX])

    def flush(self) -> None:
        self._timed(self.f.flush)

    def close(self) -> None:
        self._timed(self.f.close)

    def fileno(self) -> int:
        return self.f.fileno()


class Channel:
    """One ssh stream to an agent on the remote host. The constructor starts ssh and sends the agent without
    waiting; the agent's hello is read on first use.

    `doing` names the request the channel waits on (hello, init, plan, put, flush, commit, get): the stall
    message names it. `reading`/`writing` are when a read or write of ssh's pipes began (0: none waiting),
    `progress` when one last ended; the watchdog thread stops ssh once one has waited `timeout` seconds with
    no progress either way."""

    def __init__(self, ep: Endpoint, role: str, ssh: Sequence[str], remote_python: str):
        self.ep = ep
        self.spec = (ep, role, tuple(ssh), remote_python)
        self.taken = False
        self.timeout = stall_timeout()
        self.doing = "hello"
        self.flush_sent = False  # a push stream's flush is on its way (stage.py): a stall then is in 'flush'
        self.stalled = False
        self.reading = self.writing = 0.0
        self.progress = time.monotonic()
        remote = agent_command(remote_python, role, ep.path)
        cmd = [*ssh]
        if ep.port:
            cmd += ["-p", str(ep.port)]
        if ep.user:
            cmd += ["-l", ep.user]
        cmd += ["--", ep.host, remote]  # `--`: the host is never read as an option (parse_endpoint refuses those too)
        logging = sys.modules.get("logging")  # not imported here: it costs milliseconds before ssh starts
        if logging is not None:  # and when it is not loaded, nothing has configured it to show debug lines
            logging.getLogger("hpcscale.stage").debug("run: %s", shlex.join(cmd))
        self.stderr_fd = os.memfd_create("hpcscale-ssh-stderr")  # ssh's own words, for error messages
        self._stderr_lock = threading.Lock()
        try:
            self.p = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr_fd, bufsize=1 << 20
            )
        except FileNotFoundError:
            os.close(self.stderr_fd)
            raise RuntimeFailure(f"{cmd[0]}: command not found (set --ssh)") from None
        self._done = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="hpcscale-ssh-watchdog").start()
        self.w = _Writer(self.p.stdin, self)
        self.r = _Reader(self.p.stdout, self)
        wire = _wire()  # imported once ssh is on its way
        wire.widen_pipe(self.w.fileno())
        wire.widen_pipe(self.r.fileno())
        blobs = agent_blobs()
        self._greeted = False
        try:
            self.w.write(blobs)
            self.w.flush()
        except OSError:
            pass  # the hello read below reports what ssh said

    def _watch(self) -> None:
        """Stop ssh once a read or write has waited `timeout` seconds with nothing moving either way: the read
        then sees the end of the stream, the write a broken pipe, and `broken` names the stall. Also keeps
        ssh's stderr (the remote's, too) from growing without bound (`_trim_stderr`)."""
        tick = min(1.0, self.timeout / 4)
        while not self._done.wait(tick):
            self._trim_stderr()
            waits = [t for t in (self.reading, self.writing) if t]
            if waits and time.monotonic() - max(self.progress, min(waits)) > self.timeout:
                self.stalled = True
                self.kill()
                return

    def kill(self) -> None:
        """Stop ssh now (a stall, a protocol violation): every read and write of its pipes ends at once."""
        with contextlib.suppress(OSError):
            if self.p.poll() is None:
                self.p.kill()

    def recv(self, limit: int = REPLY_MAX, beats=False) -> dict:
        """The next message under the wire's bounds (at most `limit` header bytes); a frame that breaks the
        protocol is `violation`. `beats` (a bool, or a callable asked when a beat arrives: whether one may come
        now, decided by another thread): the agent may be working on a plan, flush or commit, and its
        {"busy": OP} beats are skipped (anywhere else one is a violation)."""
        wire = _wire()
        while True:
            try:
                msg = wire.recv(self.r, limit)
            except wire.WireError as e:
                raise self.violation(str(e)) from None
            if "busy" not in msg:
                return msg
            allowed = beats() if callable(beats) else beats
            if not (allowed and len(msg) == 1 and type(msg["busy"]) is str):
                raise self.violation("a busy beat where none may come")

    def violation(self, what: str) -> RuntimeFailure:
        """The error for a message that breaks the protocol (`what`: what was wrong); ssh is stopped first."""
        self.kill()
        return RuntimeFailure(
            f"{self.ep}: the remote broke the staging protocol in '{self.doing}': {shown(what, 300)} (not an "
            "hpcscale agent of this version, or a hostile one); ssh was stopped"
        )

    def hello(self) -> None:
        if self._greeted:
            return
        self.doing = "hello"
        try:
            hello = self.recv()
        except (OSError, EOFError):
            raise self.broken("could not start the staging agent") from None
        try:
            if "error" in hello:
                text, kind = check_error(hello)
                self.close()
                raise error_for(f"{self.ep}: {text}", kind)
            check_reply("hello", hello)
        except ProtocolError as e:
            raise self.violation(str(e)) from None
        self._greeted = True

    def init(self, agent_opts: dict) -> None:
        self.call({"op": "init", "opts": agent_opts})

    def _wait(self, timeout: float) -> None:
        """Popen.wait(timeout=...) polls, sleeping up to 50 ms between looks; a pidfd wakes us when ssh exits."""
        if self.p.poll() is not None:  # exited (and reaped: its pid may belong to another process by now)
            return
        try:
            fd = os.pidfd_open(self.p.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3
            self.p.wait(timeout=timeout)
            return
        try:
            import select

            poller = select.poll()  # not select(): it fails on descriptor numbers from 1024 up
            poller.register(fd, select.POLLIN)
            if not poller.poll(timeout * 1000):
                raise subprocess.TimeoutExpired(self.p.args, timeout)
        finally:
            os.close(fd)
        self.p.wait()

    def _trim_stderr(self) -> None:
        """Past STDERR_MAX bytes, empty ssh's stderr file (a remote can write without end): ssh writes on at
        its offset, over a hole that holds no memory, and the tail is read from the end."""
        with self._stderr_lock:
            if self.stderr_fd >= 0 and os.fstat(self.stderr_fd).st_size > STDERR_MAX:
                os.ftruncate(self.stderr_fd, 0)

    def stderr_tail(self) -> str:
        """The last words of ssh's stderr, made safe to print (`shown`)."""
        with self._stderr_lock:
            if self.stderr_fd < 0:
                return ""
            size = os.fstat(self.stderr_fd).st_size
            data = os.pread(self.stderr_fd, 2000, max(0, size - 2000))
        return shown(data.lstrip(b"\0").decode(errors="replace").strip(), 2000, lines=True)

    def broken(self, what: str) -> RuntimeFailure:
        try:
            self._wait(min(10.0, self.timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            self.p.wait()
        tail = self.stderr_tail()
        if self.stalled:
            return RuntimeFailure(
                f"{self.ep}: stalled in '{self.doing}': nothing from the remote for {self.timeout:g} s "
                f"(a stalled link or agent; {TIMEOUT_ENV} sets the limit); ssh was stopped"
                f"{': ' + tail if tail else ''}; rerun the same command to resume"
            )
        return RuntimeFailure(
            f"{self.ep}: {what} (ssh exit {self.p.returncode}){': ' + tail if tail else ''}; "
            "rerun the same command to resume"
        )

    def _limit(self, header: dict) -> int:
        """How many header bytes the reply to `header` may have: a plan's grows with its entries."""
        if header.get("op") == "plan":
            return REPLY_MAX + PLAN_REPLY_BYTES * len(header.get("entries") or ())
        return REPLY_MAX

    def call(self, *headers: dict) -> dict:
        """Send requests in one go (the agent's hello needs no round trip of its own), read one reply per
        request, each checked (`check_reply`); returns the last. The first error reply is raised."""
        try:
            for header in headers:
                _wire().send(self.w, header)
            self.w.flush()
        except OSError:
            pass  # reported by the reads below, with ssh's words
        self.hello()
        header = headers[-1]
        try:
            for header in headers:
                self.doing = header.get("op", "?")
                reply = self.recv(self._limit(header), beats=self.doing in ("plan", "commit"))
                if "error" in reply:
                    text, kind = check_error(reply)
                    raise error_for(f"{self.ep}: {text}", kind)
                check_reply(self.doing, reply)
        except ProtocolError as e:
            raise self.violation(str(e)) from None
        except (OSError, EOFError):
            raise self.broken(f"the connection broke during '{header.get('op')}'") from None
        return reply

    def discard(self) -> None:
        """End a channel nobody will use: ssh is stopped at once, whatever it was doing."""
        with contextlib.suppress(OSError):
            self.w.close()
        self.p.terminate()
        self.p.wait()
        self._release()

    def close(self) -> None:
        try:
            _wire().send(self.w, {"op": "bye"})
            self.w.close()
        except (OSError, ValueError):  # ValueError: already closed
            pass
        try:
            self._wait(min(30.0, self.timeout))
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self._release()

    def _release(self) -> None:
        self._done.set()
        with self._stderr_lock:  # never closed under the watchdog's feet (its number could be reused)
            if self.stderr_fd >= 0:
                os.close(self.stderr_fd)
                self.stderr_fd = -1


def agent_command(remote_python: str, role: str, root: str) -> str:
    """The shell command ssh runs at the other end: the agent (BOOT, which imports nothing from the working
    directory there) serving `role` for `root`. -S: the agent loads site-packages only if it needs a hash
    module (hpcscale.portable.hashing._site), so nothing of site-packages runs before BOOT either."""
    return shlex.join([*shlex.split(remote_python), "-S", "-c", BOOT, role, root])


def connect_early(src: Endpoint, dst: Endpoint, ssh: Sequence[str], remote_python: str) -> Channel | None:
    """Start ssh (and the remote agent) now, so that it comes up while the manifest is read; `stage()` takes it
    over. None unless exactly one side is remote."""
    if dst.kind == "ssh" and src.kind == "local":
        return Channel(dst, "sink", ssh, remote_python)
    if src.kind == "ssh" and dst.kind == "local":
        return Channel(src, "source", ssh, remote_python)
    return None


_prelaunched: Channel | None = None


# Every option of `hpcscale stage` (hpcscale/cli/stage_cmd.py) and whether it takes a value: the scan below
# must step over each value, or a value that looks like an option would be read as one. A test walks the
# click command's options and fails on any that is missing here (tests/stage/test_stage_prelaunch.py).
STAGE_OPTIONS = {
    "--from": True,
    "--to": True,
    "-j": True,
    "--jobs": True,
    "--check": True,
    "--bwlimit": True,
    "--sync": False,
    "--ssh": True,
    "--remote-python": True,
    "--umask": True,
    "--site": True,
    "--dry-run": False,
    "--json": False,
    "--help": False,
    "-h": False,
}
NO_EARLY_START = ("--dry-run", "--help", "-h", "--")  # nothing to connect for, or too odd to guess at


def scan_stage_args(argv: Sequence[str]) -> dict[str, str | None] | None:
    """--from, --to, --ssh and --remote-python (None where not given) as click would most likely parse them
    from `hpcscale stage`'s raw arguments, or None where nothing should start early (NO_EARLY_START)."""
    if any(arg in NO_EARLY_START for arg in argv):
        return None
    opts: dict[str, str | None] = {"--from": None, "--to": None, "--ssh": None, "--remote-python": None}
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if STAGE_OPTIONS.get(name):
            value = value if eq else next(it, None)
            if name in opts:
                opts[name] = value
    return opts


def prelaunch(argv: Sequence[str]) -> None:
    """Called with `hpcscale stage`'s arguments before the CLI imports click and the rest: start ssh now if
    they name exactly one ssh endpoint. This is a best guess at what click will parse, never an error: the
    command adopts the channel only if it matches what click parsed (`take_prelaunched`); otherwise, or if the
    command never runs (help, a rejected command line), ssh is stopped."""
    global _prelaunched
    try:
        opts = scan_stage_args(argv)
        if opts is None or opts["--from"] is None or opts["--to"] is None:
            return
        ssh = opts["--ssh"] or os.environ.get("HPCSCALE_SSH") or DEFAULT_SSH
        remote_python = opts["--remote-python"] or os.environ.get("HPCSCALE_REMOTE_PYTHON") or DEFAULT_REMOTE_PYTHON
        src, dst = parse_endpoint(opts["--from"]), parse_endpoint(opts["--to"])
        _prelaunched = connect_early(src, dst, shlex.split(ssh), remote_python)
        if _prelaunched is not None:  # click may reject the command line: then nothing takes it
            import atexit

            atexit.register(discard_prelaunched)
    except Exception:  # anything odd here is for click to report
        _prelaunched = None


def discard_prelaunched() -> None:
    """Stop the ssh `prelaunch` started if no command took it (a rejected command line): at exit, and before
    hpcscale.cli.entry ends the process without the interpreter's teardown (which would skip atexit)."""
    global _prelaunched
    ch, _prelaunched = _prelaunched, None
    if ch is not None:
        ch.discard()


def take_prelaunched(src: Endpoint, dst: Endpoint, ssh: Sequence[str], remote_python: str) -> Channel | None:
    """The channel `prelaunch` started, if it is the one these parsed options call for."""
    global _prelaunched
    ch, _prelaunched = _prelaunched, None
    if ch is None:
        return None
    role = "sink" if dst.kind == "ssh" else "source"
    if ch.spec == (dst if role == "sink" else src, role, tuple(ssh), remote_python):
        return ch
    ch.discard()
    return None

"""Endpoints (`/path`, `ssh://[user@]host[:port]/path`) and the ssh stream to a staging agent.

Kept light on imports: `hpcscale stage` starts ssh from here before it loads the rest of itself (even click:
see `prelaunch`), so the connection (a third of a second on loopback, more across sites) comes up while the
command loads and reads its manifest.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from collections import namedtuple
from collections.abc import Sequence

from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.xsite import DEFAULT_REMOTE_PYTHON, DEFAULT_SSH
from hpcscale.xsite.bootstrap import BOOT, agent_blobs


def _wire():
    """The wire protocol (hpcscale.portable.wire), imported on first use: not needed to start ssh."""
    from hpcscale.portable import wire

    return wire


def error_for(message: str, kind: str) -> Exception:
    """The hpcscale error (and so the exit code) for an agent error kind."""
    return {"input": BadInput, "verify": VerificationFailure}.get(kind, RuntimeFailure)(message)


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

        u = urlsplit(text)
        try:
            port = u.port
        except ValueError:
            raise BadInput(f"{what}: '{text}': the port is not a number") from None
        if not u.hostname or not u.path or u.path == "/":
            raise BadInput(f"{what}: '{text}': expected ssh://[user@]host[:port]/path")
        path = unquote(u.path)
        if path.startswith("/~"):
            path = path[1:]
        return Endpoint("ssh", path, u.hostname, u.username or "", port)
    if "://" in text:
        raise BadInput(f"{what}: '{text}': unknown scheme (use a local path or ssh://host/path)")
    return Endpoint("local", os.path.abspath(os.path.expanduser(text)))


class Channel:
    """One ssh stream to an agent on the remote host. The constructor starts ssh and sends the agent without
    waiting; the agent's hello is read on first use."""

    def __init__(self, ep: Endpoint, role: str, ssh: Sequence[str], remote_python: str):
        self.ep = ep
        self.spec = (ep, role, tuple(ssh), remote_python)
        self.taken = False
        # -S: the agent loads site-packages only if it needs a hash module (hpcscale.portable.hashing._site)
        remote = shlex.join([*shlex.split(remote_python), "-S", "-c", BOOT, role, ep.path])
        cmd = [*ssh]
        if ep.port:
            cmd += ["-p", str(ep.port)]
        if ep.user:
            cmd += ["-l", ep.user]
        cmd += [ep.host, remote]
        logging = sys.modules.get("logging")  # not imported here: it costs milliseconds before ssh starts
        if logging is not None:  # and when it is not loaded, nothing has configured it to show debug lines
            logging.getLogger("hpcscale.stage").debug("run: %s", shlex.join(cmd))
        self.stderr_fd = os.memfd_create("hpcscale-ssh-stderr")  # ssh's own words, for error messages
        try:
            self.p = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr_fd, bufsize=1 << 20
            )
        except FileNotFoundError:
            os.close(self.stderr_fd)
            raise RuntimeFailure(f"{cmd[0]}: command not found (set --ssh)") from None
        self.w = self.p.stdin
        self.r = self.p.stdout
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

    def hello(self) -> None:
        if self._greeted:
            return
        try:
            hello = _wire().recv(self.r)
        except (OSError, EOFError):
            raise self.broken("could not start the staging agent") from None
        if "error" in hello:
            self.close()
            raise error_for(f"{self.ep}: {hello['error']}", hello.get("kind", "runtime"))
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

    def stderr_tail(self) -> str:
        os.lseek(self.stderr_fd, 0, os.SEEK_SET)
        data = b""
        while chunk := os.read(self.stderr_fd, 1 << 16):
            data += chunk
        return data[-2000:].decode(errors="replace").strip()

    def broken(self, what: str) -> RuntimeFailure:
        try:
            self._wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
        tail = self.stderr_tail()
        return RuntimeFailure(
            f"{self.ep}: {what} (ssh exit {self.p.returncode}){': ' + tail if tail else ''}; "
            "rerun the same command to resume"
        )

    def call(self, *headers: dict) -> dict:
        """Send requests in one go (the agent's hello needs no round trip of its own), read one reply per
        request; returns the last. The first error reply is raised."""
        try:
            for header in headers:
                _wire().send(self.w, header)
            self.w.flush()
        except OSError:
            pass  # reported by the reads below, with ssh's words
        self.hello()
        header = headers[-1]
        try:
            for _ in headers:
                reply = _wire().recv(self.r)
                if "error" in reply:
                    raise error_for(f"{self.ep}: {reply['error']}", reply.get("kind", "runtime"))
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
        except OSError:
            pass
        try:
            self._wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self._release()

    def _release(self) -> None:
        if self.stderr_fd >= 0:
            os.close(self.stderr_fd)
            self.stderr_fd = -1


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
# click command's options and fails on any that is missing here (tests/test_stage_prelaunch.py).
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

"""A real OpenSSH server on the loopback interface with throwaway keys, for the ssh transport's tests and bench.

It runs as the current user (root in CI) from Debian's openssh-server, with its own host key, authorized key,
config and pid file under `workdir`, on a port the kernel picks; `stop()` kills only it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"


def available() -> bool:
    return os.path.exists(SSHD) and shutil.which("ssh") is not None and shutil.which("ssh-keygen") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackSshd:
    def __init__(self, workdir: Path, *, netns: str | None = None):
        self.prefix = ["ip", "netns", "exec", netns] if netns else []  # sshd and its probe run in this namespace
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> LoopbackSshd:
        d = self.dir
        for name in ("host_key", "client_key"):
            if not (d / name).exists():
                subprocess.run(
                    ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)],
                    check=True,
                    capture_output=True,
                )
        (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
        os.chmod(d / "authorized_keys", 0o600)
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory Debian's sshd insists on
        # sshd takes its port as a number: one the kernel found free, let go, then named to sshd, which another
        # process may bind first. sshd then cannot listen and exits; it starts again on another port.
        for _ in range(5):
            self.port = _free_port()
            if self._serve():
                return self
        raise RuntimeError(f"sshd found each of 5 free ports taken: {(d / 'sshd.log').read_text()[-1000:]}")

    def _serve(self) -> bool:
        """sshd on self.port, until it accepts a login (True); False when it exits because the port was taken."""
        d = self.dir
        (d / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "PermitRootLogin prohibit-password\nMaxStartups 64\nMaxSessions 64\nLogLevel ERROR\n"
            "AcceptEnv none\nSubsystem sftp internal-sftp\n"
            # a client gone without a word (a broken link) ends its session, and the agent with it, in 15 s
            "ClientAliveInterval 5\nClientAliveCountMax 3\n"
        )
        log = d / "sshd.log"
        logged = log.stat().st_size if log.exists() else 0
        self.proc = subprocess.Popen(
            [*self.prefix, SSHD, "-D", "-e", "-f", str(d / "sshd_config")],
            stdout=subprocess.DEVNULL,
            stderr=open(log, "ab"),  # noqa: SIM115 - sshd holds it until stop()
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = log.read_bytes()[logged:].decode(errors="replace")
                if "Address already in use" in said:
                    return False
                raise RuntimeError(f"sshd exited: {said[-1000:]}")
            try:  # bounded: whatever took the port may accept and never answer
                probe = subprocess.run(
                    [*self.prefix, *self.ssh_command(), "-o", "ConnectTimeout=5", "-p", str(self.port), "127.0.0.1",
                     "true"], capture_output=True, timeout=10,
                )  # fmt: skip
            except subprocess.TimeoutExpired as e:
                probe = subprocess.CompletedProcess(e.cmd, 255, b"", e.stderr or b"probe timed out")
            if probe.returncode == 0:
                return True
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sshd on port {self.port} did not accept a login: {probe.stderr.decode()[-500:]}")

    def ssh_command(self) -> list[str]:
        """ssh with the throwaway key, no host-key prompt, no agent or user config: usable as rsync -e."""
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-i",
            str(self.dir / "client_key"),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            f"UserKnownHostsFile={self.dir / 'known_hosts'}",
            "-o",
            "LogLevel=ERROR",
        ]

    def ssh_string(self) -> str:
        """The ssh command for `--ssh` or `rsync -e`, including the port."""
        return shlex.join([*self.ssh_command(), "-p", str(self.port)])

    def url(self, path: str | os.PathLike) -> str:
        return f"ssh://127.0.0.1:{self.port}{os.path.abspath(path)}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def capped_netns(name: str, rate: str):
    """A network namespace NAME whose loopback is capped at `rate` by tbf (netem does not work on this kernel,
    tbf does), for an sshd and the clients that reach it. Needs root and iproute2; removed on exit."""
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        # A WAN's MTU, not loopback's 64 KiB: tbf drops a packet larger than its bucket, which would stall TCP.
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "mtu", "1500", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                        "burst", "256kb", "latency", "50ms"], check=True)  # fmt: skip
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)

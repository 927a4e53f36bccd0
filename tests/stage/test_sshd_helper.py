"""The tests' loopback sshd (tests/helpers/sshd.py) starts whatever took the port it was given first: sshd takes
its port as a number found free and let go, which another process may bind before sshd does."""

from __future__ import annotations

import socket
import sys

import pytest
from conftest import REPO, need

sys.path.insert(0, str(REPO / "tests" / "helpers"))
import sshd


@pytest.mark.slow
def test_sshd_moves_to_another_port_when_its_port_was_taken_by_a_silent_listener(tmp_path, monkeypatch):
    need(sshd.available(), "sshd and ssh (apt-get install openssh-server openssh-client)")
    with socket.socket() as taken:  # accepts connections and never answers: a probe must not wait on it for ever
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = iter([taken.getsockname()[1]])
        free = sshd._free_port
        monkeypatch.setattr(sshd, "_free_port", lambda: next(first, None) or free())
        server = sshd.LoopbackSshd(tmp_path / "sshd").start()
        try:
            assert server.port != taken.getsockname()[1]
            assert "Address already in use" in (tmp_path / "sshd" / "sshd.log").read_text()
        finally:
            server.stop()

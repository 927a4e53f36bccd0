"""`hpcscale stage` against a partner site that runs anything in place of the staging agent: a crafted remote
`python3` (`--remote-python`) over the real loopback sshd speaks, abuses or stalls the wire protocol, and the
stage must end promptly with a clean error (exit 1, or 3 for a verification failure), naming the remote and
what was wrong, ssh stopped, no process left behind, nothing committed, nothing raw on the terminal.

Each class of attack is one parametrized test; stalls run under HPCSCALE_STAGE_TIMEOUT=2 (the stall
timeout's one knob, hpcscale.xsite.channel.stall_timeout)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash
from conftest import run_cli

from hpcscale.data.manifest import FileEntry, Manifest, manifest_text
from hpcscale.errors import BadInput, RuntimeFailure
from hpcscale.xsite.channel import parse_endpoint
from hpcscale.xsite.stage import StageOptions
from hpcscale.xsite.stage import stage as stage_lib

# The crafted agent: reads the bootstrap's blobs as BOOT would, then plays CASE. It blocks on stdin until
# the end of the stream wherever it stalls, so it ends when ssh's session does (sshd closes its stdin).
AGENT = r"""
import json, os, struct, sys, time
CASE, PIDS = sys.argv[1], sys.argv[2]
with open(PIDS, "a") as f:
    f.write("%d\n" % os.getpid())
out = sys.stdout.buffer

def r(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            sys.exit(0)
        b += c
    return b

def g():
    return r(int(r(11)))

def raw(data):
    try:
        out.write(data)
        out.flush()
    except OSError:
        sys.exit(0)

def send(h, payload=b""):
    b = h if isinstance(h, bytes) else json.dumps(h).encode()
    raw(struct.pack(">I", len(b)) + b + payload)

def recv():
    (n,) = struct.unpack(">I", r(4))
    return json.loads(r(n))

def stall():
    while os.read(0, 1 << 16):
        pass
    sys.exit(0)

def stall_unread():  # reads nothing more: a sender's writes fill the pipe; ends when our stdout's reader goes
    import select
    p = select.poll()
    p.register(1, select.POLLERR | select.POLLHUP)
    p.poll()
    sys.exit(0)

g(); g(); names = g().decode().split()
for _ in names:
    g()
if CASE == "stall-hello":
    stall()
if CASE == "stderr-escape":
    sys.stderr.write("\x1b[2J\x1b]8;;http://evil.example/\x07CLICK\x1b]8;;\x07 [link=http://evil.example/]x[/link]\n")
    sys.exit(1)
send({"hello": 1, "python": "3.11"})
root = sys.argv[-1]
while True:
    req = recv()
    op = req.get("op")
    if op == "bye":
        sys.exit(0)
    if op == "init":
        if CASE == "stall-init":
            stall()
        send({"ready": True, "root": root})
    elif op == "plan":
        entries = req["entries"]
        n = len(entries)
        good = [0] * n
        info = {"hashed": 0, "hashed_bytes": 0, "proven": 0, "parts": 0}
        reply = {"statuses": good, "info": info, "clean": False, "lock": None}
        if CASE == "stall-plan":
            stall()
        elif CASE == "plan-slow-beats":  # works longer than the stall timeout, and says so
            for _ in range(12):
                send({"busy": "plan"})
                time.sleep(0.25)
        elif CASE == "plan-short":
            reply["statuses"] = good[1:]
        elif CASE == "plan-float":
            reply["statuses"] = [0.5] * n
        elif CASE == "plan-string":
            reply["statuses"] = ["0"] * n
        elif CASE == "plan-offset":
            reply["statuses"] = [e[1] + 1 for e in entries]
        elif CASE == "plan-info-list":
            reply["info"] = []
        elif CASE == "plan-record-ignored":
            reply["info"] = dict(info, record_ignored={"x": 1})
        elif CASE == "plan-proven":
            reply["statuses"] = [-1] * n
            reply["info"] = dict(info, proven=10**9, hashed=10**9)
        elif CASE == "plan-10m":
            send(b'{"statuses":[' + b"-1," * 10_000_000 + b'-1],"info":{}}')
            stall()
        elif CASE == "plan-error-escape":
            reply = {"error": "\x1b]8;;http://evil.example/\x07CLICK\x1b]8;;\x07\x1b[2J\r\u202e", "kind": "runtime"}
        elif CASE == "plan-error-kind":
            reply = {"error": "x", "kind": "exit-0-please"}
        elif CASE == "plan-error-list":
            reply = {"error": ["x"], "kind": "runtime"}
        send(reply)
    elif op == "put":
        if CASE == "stall-put-unread":
            stall_unread()
        data = r(req["n"])
        if CASE == "stall-put":
            stall()
        if CASE == "ack-unknown":
            send({"path": "not/sent.bin", "ok": True})
        elif CASE == "ack-twice":
            send({"path": req["path"], "ok": True})
            send({"path": req["path"], "ok": True})
        else:
            send({"path": req["path"], "ok": True})
    elif op == "flush":
        if CASE == "stall-flush":
            stall()
        send({"flushed": True})
    elif op == "commit":
        send({"committed": True})
    elif op == "get":
        path = req["path"]
        data = open(os.path.join(root, path), "rb").read()
        reply = {"path": path, "n": len(data), "size": len(data)}
        if CASE == "get-missing-n":
            del reply["n"]
        elif CASE == "get-float":
            send(b"1.5"); stall()
        elif CASE == "get-list":
            send(b"[1, 2]"); stall()
        elif CASE == "get-bad-json":
            send(b"{not json"); stall()
        elif CASE == "get-deep-json":
            send(b"[" * 200_000 + b"]" * 200_000); stall()
        elif CASE == "get-1gib-header":
            raw(struct.pack(">I", 1 << 30) + b"{" * 65536); stall()
        elif CASE == "get-4gib-prefix":
            raw(b"\xff\xff\xff\xff"); stall()
        elif CASE == "get-negative-n":
            reply["n"] = -1
        elif CASE == "get-more-n":
            reply["n"] = len(data) + 100
            data += bytes(100)
        elif CASE == "get-nan":
            send(b'{"path": "x", "n": NaN}'); stall()
        elif CASE == "stall-midfile":
            send(reply, data[: len(data) // 2]); stall()
        if CASE == "get-beat":
            send({"busy": "get"})
        if CASE == "get-extra-bytes":
            data += b"\x00\x00\x00\x05junk!"
        send(reply, data)
"""

EMPTY = json.dumps({"format": "hpcscale-manifest", "version": 1, "hash_algorithm": "xxh128", "files": []})
N_FILES = 70  # more than a pull stream's window of 64 gets: the old receiver's death hung the stage here


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for i in range(N_FILES):
        data = os.urandom(50 + i)
        (src / f"f{i:03d}.bin").write_bytes(data)
        st = (src / f"f{i:03d}.bin").stat()
        files.append(FileEntry(f"f{i:03d}.bin", len(data), st.st_mtime_ns, xxhash.xxh3_128(data).hexdigest(), 0o644))
    return src, Manifest("xxh128", files)


def _agent(tmp_path: Path, case: str) -> tuple[str, Path]:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    pids = tmp_path / "pids"
    return f"{sys.executable} {script} {case} {pids}", pids


def _left_behind(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (ssh, its remote command): none may outlive the stage."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(pid))
    return found


def _no_process_left(marker: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _left_behind(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _left_behind(marker), f"processes left behind: {_left_behind(marker)}"


def _run(sshd, tmp_path, tree, case, push, monkeypatch, timeout=1.0) -> tuple[object, float]:
    """The stage, in a thread with a deadline (a hang is a failure, not a stuck test run)."""
    monkeypatch.setenv("HPCSCALE_STAGE_TIMEOUT", str(timeout))
    src, manifest = tree
    remote_python, _ = _agent(tmp_path, case)
    dst = tmp_path / "dst"
    dst.mkdir()
    if push:
        frm, to = parse_endpoint(str(src)), parse_endpoint(sshd.url(dst))
    else:
        frm, to = parse_endpoint(sshd.url(src)), parse_endpoint(str(dst))
    opts = StageOptions(jobs=1, ssh=[*sshd.ssh_command(), "-p", str(sshd.port)], remote_python=remote_python)
    box: list = []

    def go():
        try:
            box.append(stage_lib(manifest, manifest_text(manifest), frm, to, opts))
        except BaseException as e:
            box.append(e)

    t0 = time.monotonic()
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), f"{case}: the stage hung"
    seconds = time.monotonic() - t0
    _no_process_left(str(tmp_path / "agent.py"))
    if isinstance(box[0], BaseException):
        assert not (dst / "manifest.json").exists(), "nothing may be committed"
    return box[0], seconds


PULL_VIOLATIONS = {
    "get-missing-n": "announcing None bytes",
    "get-float": "JSON float",
    "get-list": "JSON list",
    "get-bad-json": "not valid JSON",
    "get-deep-json": "nested too deeply",
    "get-1gib-header": "over the limit",
    "get-4gib-prefix": "over the limit",
    "get-negative-n": "announcing -1 bytes",
    "get-more-n": "announcing",
    "get-nan": "NaN is not a JSON value",
    "get-beat": "a busy beat where none may come",
    "get-extra-bytes": "not valid JSON",  # the junk is read as the next frame: 5 bytes, 'junk!'
}


@pytest.mark.parametrize("case", sorted(PULL_VIOLATIONS))
def test_a_pull_reply_that_breaks_the_protocol_fails_the_stage_promptly(sshd, tmp_path, tree, case, monkeypatch):
    error, seconds = _run(sshd, tmp_path, tree, case, False, monkeypatch, timeout=30)
    assert isinstance(error, RuntimeFailure), repr(error)
    text = str(error)
    assert "broke the staging protocol in 'get'" in text and "127.0.0.1" in text, text
    assert PULL_VIOLATIONS[case] in text, text
    assert seconds < 10, seconds  # never the stall timeout (30 s here): the violation itself ends it


PUSH_VIOLATIONS = {
    "plan-short": "69 statuses for 70 files",
    "plan-float": "status 0.5",
    "plan-string": "status '0'",
    "plan-offset": "status 51 for 'f000.bin' (50 bytes)",
    "plan-info-list": "info is []",
    "plan-proven": "claiming 1000000000 files proven by hash of 70 up to date",
    "plan-record-ignored": "info.record_ignored is {'x': 1}",
    "plan-10m": "over the limit",
    "plan-error-kind": "unknown kind",
    "plan-error-list": "message is a list",
    "ack-unknown": "not/sent.bin', which is not in flight",
    "ack-twice": "which is not in flight (or acknowledged already)",
}


@pytest.mark.parametrize("case", sorted(PUSH_VIOLATIONS))
def test_a_push_reply_that_breaks_the_protocol_fails_the_stage_promptly(sshd, tmp_path, tree, case, monkeypatch):
    error, seconds = _run(sshd, tmp_path, tree, case, True, monkeypatch, timeout=30)
    assert isinstance(error, RuntimeFailure), repr(error)
    text = str(error)
    assert "broke the staging protocol" in text and PUSH_VIOLATIONS[case] in text, text
    assert error.result.verified <= error.result.files and error.result.proven_by_hash == 0  # type: ignore[attr-defined]
    assert seconds < 10, seconds


STALLS = {
    "stall-hello": ("pull", "hello"),
    "stall-init": ("pull", "init"),
    "stall-midfile": ("pull", "get"),
    "stall-plan": ("push", "plan"),
    "stall-put": ("push", "put"),
    "stall-put-unread": ("push", "put"),
    "stall-flush": ("push", "flush"),
}


@pytest.mark.parametrize("case", sorted(STALLS))
def test_a_remote_that_stalls_fails_the_stage_naming_where(sshd, tmp_path, tree, case, monkeypatch):
    kind, where = STALLS[case]
    error, seconds = _run(sshd, tmp_path, tree, case, kind == "push", monkeypatch, timeout=2.0)
    assert isinstance(error, RuntimeFailure), repr(error)
    text = str(error)
    assert f"stalled in '{where}'" in text and "HPCSCALE_STAGE_TIMEOUT" in text, text
    assert seconds < 10, seconds


def test_a_remote_that_stops_reading_a_large_file_fails_the_blocked_sender(sshd, tmp_path, monkeypatch):
    """The sink reads nothing of a 16 MiB put: the pipes and ssh's window fill and the sender's write blocks;
    the stall timeout covers writes as well as reads."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(16 << 20)
    (src / "big.bin").write_bytes(data)
    st = (src / "big.bin").stat()
    manifest = Manifest("xxh128", [FileEntry("big.bin", len(data), st.st_mtime_ns, xxhash.xxh3_128(data).hexdigest())])
    error, seconds = _run(sshd, tmp_path, (src, manifest), "stall-put-unread", True, monkeypatch, timeout=2.0)
    assert isinstance(error, RuntimeFailure) and "stalled in 'put'" in str(error), repr(error)
    assert seconds < 10, seconds


def test_a_remote_that_works_longer_than_the_timeout_and_says_so_is_not_a_stall(sshd, tmp_path, tree, monkeypatch):
    """Busy beats during a plan (the real agent sends one every timeout/4 while it plans, flushes or commits)."""
    result, seconds = _run(sshd, tmp_path, tree, "plan-slow-beats", True, monkeypatch, timeout=2.0)
    assert not isinstance(result, BaseException), result
    assert result.committed and seconds > 2.5, seconds


def test_a_crafted_agent_that_keeps_the_protocol_is_counted_by_what_this_side_saw(sshd, tmp_path, tree, monkeypatch):
    """The crafted sink with nothing to abuse: every put acknowledged once, and the summary counts those."""
    result, _ = _run(sshd, tmp_path, tree, "plain", True, monkeypatch, timeout=30)
    assert not isinstance(result, BaseException), result
    assert (result.sent, result.verified, result.proven_by_hash, result.up_to_date) == (N_FILES, N_FILES, 0, 0)
    assert result.committed


@pytest.mark.parametrize("case", ["plan-error-escape", "stderr-escape"])
def test_remote_text_reaches_the_terminal_without_escapes(sshd, tmp_path, tree, case):
    src, manifest = tree
    (src / "manifest.json").write_text(manifest_text(manifest))
    remote_python, _ = _agent(tmp_path, case)
    ssh = " ".join([*sshd.ssh_command(), "-p", str(sshd.port)])
    r = run_cli(
        "stage", str(src / "manifest.json"), "--from", str(src), "--to", sshd.url(tmp_path / "dst"),
        "--ssh", ssh, "--remote-python", remote_python, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr and "\r" not in r.stderr and "\u202e" not in r.stderr
    assert "\\x1b" in r.stderr, r.stderr  # shown, as a visible escape
    _no_process_left(str(tmp_path / "agent.py"))


@pytest.mark.parametrize(
    "url",
    [
        "ssh://-oProxyCommand=touch%20{m}/data",
        "ssh://-oProxyCommand=x@host/data",
        "ssh://ho\tst/data",
        "ssh://us\x1ber@host/data",
    ],
)
def test_an_ssh_host_or_user_that_ssh_would_take_for_an_option_is_refused(tmp_path, url):
    marker = tmp_path / "ran"
    url = url.replace("{m}", str(marker))
    with pytest.raises(BadInput) as e:
        parse_endpoint(url, "--to")
    assert "--to" in str(e.value) and ("begins with '-'" in str(e.value) or "control character" in str(e.value))
    (tmp_path / "m.json").write_text(EMPTY)
    r = run_cli("stage", str(tmp_path / "m.json"), "--from", str(tmp_path), "--to", url)
    assert r.returncode == 2 and "--to" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()


def test_ssh_is_given_the_host_after_double_dash(tmp_path):
    argv_file = tmp_path / "argv"
    fake = tmp_path / "fake-ssh"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {argv_file}\nexit 255\n')
    fake.chmod(0o755)
    (tmp_path / "m.json").write_text(EMPTY)
    to = "ssh://u@h.example:2222/d"
    r = run_cli("stage", str(tmp_path / "m.json"), "--from", str(tmp_path), "--to", to, "--ssh", str(fake))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    argv = argv_file.read_text().splitlines()
    assert argv[:5] == ["-p", "2222", "-l", "u", "--"] and argv[5] == "h.example", argv


def test_config_validate_refuses_an_xsite_reach_ssh_would_take_for_an_option(tmp_path):
    base = {
        "name": "t",
        "aggregator": "a",
        "round_steps": 10,
        "keys": "/k",
        "quorum": {"min_sites": 1},
        "sites": [{"name": "a", "run": "/r", "state": "/s", "reach": "ssh://-oProxyCommand=x/s", "key": "/k/a.key"}],
    }
    path = tmp_path / "x.yaml"
    path.write_text(json.dumps(base))
    r = run_cli("config", "validate", "--kind", "xsite", str(path))
    assert r.returncode == 2 and "begins with '-'" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "min_sites" not in r.stdout + r.stderr  # the reach is the one thing wrong
    base["sites"][0]["reach"] = "ssh://-x@host/s"
    path.write_text(json.dumps(base))
    r = run_cli("config", "validate", "--kind", "xsite", str(path))
    assert r.returncode == 2 and "begins with '-'" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_bad_stall_timeout_setting_is_bad_input(monkeypatch):
    from hpcscale.xsite.channel import stall_timeout

    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv("HPCSCALE_STAGE_TIMEOUT", bad)
        with pytest.raises(BadInput, match="HPCSCALE_STAGE_TIMEOUT"):
            stall_timeout()
    monkeypatch.setenv("HPCSCALE_STAGE_TIMEOUT", "2.5")
    assert stall_timeout() == 2.5


@pytest.mark.parametrize("url", ["ssh://[::1/p", "ssh://[-oProxyCommand=x]/p", "ssh://host:99999999/p"])
def test_an_endpoint_urlsplit_refuses_is_bad_input_not_a_traceback(url):
    from hpcscale.errors import BadInput
    from hpcscale.xsite.channel import parse_endpoint

    with pytest.raises(BadInput):
        parse_endpoint(url, "--to")

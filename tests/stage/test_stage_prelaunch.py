"""`hpcscale stage` starts ssh from its raw arguments before click loads (hpcscale.xsite.channel.prelaunch,
about 50 ms sooner). That scan must know every option click knows for `stage`, and whether it takes a value:
otherwise a value that looks like an option is read as one, and the wrong connection (or none) is started."""

from __future__ import annotations

import click
import pytest

from hpcscale.cli.main import cli
from hpcscale.cli.stage_cmd import stage
from hpcscale.xsite.channel import NO_EARLY_START, STAGE_OPTIONS, scan_stage_args


def _options() -> list[click.Option]:
    """stage's options as the real CLI builds them (help names come from the group's context settings)."""
    ctx = click.Context(stage, parent=click.Context(cli, **cli.context_settings), info_name="stage")
    return [p for p in stage.get_params(ctx) if isinstance(p, click.Option)]


def test_the_scan_knows_every_option_of_stage_and_whether_it_takes_a_value():
    names = set()
    for opt in _options():
        takes_value = not opt.is_flag and not opt.count
        for name in (*opt.opts, *opt.secondary_opts):
            names.add(name)
            assert name in STAGE_OPTIONS, f"teach hpcscale.xsite.channel.STAGE_OPTIONS the stage option {name}"
            assert STAGE_OPTIONS[name] == takes_value, f"{name}: STAGE_OPTIONS says takes a value={not takes_value}"
    assert set(STAGE_OPTIONS) == names, f"not options of stage: {sorted(set(STAGE_OPTIONS) - names)}"


# values chosen to look like options: a scan that does not step over them reads --to or --from wrongly
VALUES = {
    "--bwlimit": "--to",
    "--site": "--from",
    "--check": "hash",
    "--jobs": "3",
    "--ssh": "ssh -p 2222 -o BatchMode=yes",
    "--remote-python": "env PYTHONPATH=/x python3",
    "--from": "/data/src",
    "--to": "ssh://user@dtn.example.org:2200/~/dst",
}


@pytest.mark.parametrize("form", ["spaced", "equals"])
def test_the_scan_reads_what_click_parses(tmp_path, form):
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    argv = [str(manifest), "--sync", "--json"]
    for name, value in VALUES.items():
        argv += [f"{name}={value}"] if form == "equals" else [name, value]
    parsed = stage.make_context("stage", list(argv)).params
    assert scan_stage_args(argv) == {
        "--from": parsed["src"],
        "--to": parsed["dst"],
        "--ssh": parsed["ssh_cmd"],
        "--remote-python": parsed["remote_python"],
    }


@pytest.mark.parametrize("extra", NO_EARLY_START)
def test_nothing_starts_early_for_help_dry_runs_and_double_dashes(extra):
    assert scan_stage_args(["m.json", "--from", "/a", "--to", "ssh://h/b", extra]) is None


def test_stage_ends_without_teardown_yet_every_byte_and_exit_code_arrives(tmp_path):
    """`hpcscale stage` ends the process once its output is flushed (hpcscale.util.pystart.exit_now): the --json
    document arrives whole through a pipe, a bad input still exits 2 with its message, and a reader that
    closed the pipe early gets the ordinary exit, not a hang or a lost exit code."""
    import json
    import subprocess
    import sys

    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(300):
        (src / "d" / f"f{i:03d}.txt").write_text(f"file {i}\n" * 10)
    manifest = tmp_path / "manifest.json"
    hpcscale = [sys.executable, "-m", "hpcscale"]
    subprocess.run([*hpcscale, "manifest", "build", str(src), "-o", str(manifest)], check=True, capture_output=True)
    stage_args = [*hpcscale, "stage", str(manifest), "--from", str(src), "--to", str(tmp_path / "dst"), "--json"]
    done = subprocess.run(stage_args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sent"] == 300
    assert (tmp_path / "dst" / "manifest.json").is_file() and (tmp_path / "dst" / "d" / "f299.txt").is_file()

    manifest.write_text('{"format": "hpcscale-manifest", "version": 1, "files": 5}')
    bad = subprocess.run(stage_args, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "manifest.json: hash_algorithm" in bad.stderr and "Traceback" not in bad.stderr

    closed = subprocess.Popen([*stage_args[:-1], "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    closed.stdout.close()  # nobody reads: the flush at the end fails
    assert closed.wait(timeout=120) != 0


def test_an_early_ssh_nothing_took_is_stopped_when_click_refuses_the_command_line(tmp_path):
    """`stage` starts ssh before click parses; when click then refuses the command line (exit 2), the process
    ends without the interpreter's teardown, and that early ssh must still be stopped, not left running."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    started = tmp_path / "ssh.started"
    seconds = f"{300 + os.getpid() % 1000}.{time.monotonic_ns() % 1000}"  # names this test's sleep in /proc
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep {seconds}\n")
    fake_ssh.chmod(0o755)
    (tmp_path / "src").mkdir()
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    argv = [sys.executable, "-m", "hpcscale", "stage", str(manifest), "--from", str(tmp_path / "src")]
    argv += ["--to", "ssh://nowhere.invalid/dst", "--ssh", str(fake_ssh), "--check", "bogus"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--check" in done.stderr, done.stderr

    def ours() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[:2] == [b"sleep", seconds.encode()]:
                found.append(int(pid))
        return found

    # the early ssh started (here, before click had even loaded) and is gone: stopped, not left to sleep
    assert started.exists(), "the early ssh never started: this test proves nothing"
    left = ours()
    for pid in left:
        os.kill(pid, 9)
    assert left == [], f"the early ssh was left running: pids {left}"

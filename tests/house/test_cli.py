"""The CLI's promises to login nodes: fast start, torch never imported for non-training commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from hpcscale import __version__

PROBE = """
import json, sys
from hpcscale.cli.main import cli
try:
    cli({args!r})
except SystemExit as e:
    code = e.code
print(json.dumps({{"code": code, "torch": "torch" in sys.modules, "mpi4py": "mpi4py" in sys.modules}}))
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["config", "validate", "site_configs/localcluster.yaml", "docs/examples/gpt-dgx.yaml"],
        ["config", "show", "localcluster"],
        ["config", "--help"],
        ["doctor", "--help"],
        ["report", "--help"],
    ],
    ids=["help", "validate", "show", "config-help", "doctor-help", "report-help"],
)
def test_login_node_commands_do_not_import_torch(args):
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] in (0, None), out.stderr
    assert result["torch"] is False
    assert result["mpi4py"] is False


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert __version__ in result.stdout


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["manifest", "verify", "{tmp}/manifest.json"], 2),
        (["ckpt", "ls", "/nonexistent/run"], 2),
        (["status", "{tmp}"], 2),
        (["resume", "{tmp}", "--dry-run"], 2),
        (["ckpt", "verify", "{tmp}/step-00000001"], None),
    ],
    ids=["manifest-verify", "ckpt-ls-usage", "status", "resume", "ckpt-verify"],
)
def test_an_error_with_json_is_a_json_document(tmp_path, args, code):
    """A script that asked for JSON can parse the failure too: stdout is one JSON document with the message and
    the exit code, which the process exits with; the message still goes to stderr."""
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "manifest.json").write_text('{"format": 1}')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = run_cli(*args, "--json")
    assert r.returncode != 0 and (code is None or r.returncode == code), r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == r.returncode and doc["error"] and doc["error"] in r.stderr, (doc, r.stderr)
    plain = run_cli(*args)
    assert plain.returncode == r.returncode and plain.stdout == ""


def test_unknown_command_is_usage_error():
    result = run_cli("frobnicate")
    assert result.returncode == 2
    assert "No such command" in result.stderr

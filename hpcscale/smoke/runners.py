"""How `hpcscale smoke` runs each of its jobs: through mpirun on this machine (--local), or sbatch on a Slurm
site, waiting for the job to end. Both write the job's spec next to its run directory and return a JobOutcome;
everything else about the smoke test is shared (hpcscale.smoke.checks)."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from hpcscale.config.load import load_job
from hpcscale.portable.files import atomic_write
from hpcscale.smoke.checks import JobOutcome
from hpcscale.util.proc import CommandFailed
from hpcscale.util.trust import private_dir

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}  # fmt: skip


def _spec_file(root: Path, name: str, spec: dict) -> Path:
    """ROOT/specs/NAME.yaml, the job spec the job is loaded from: in a directory only the user can write (made
    so, or refused: a spec names the program the ranks run), written through a fresh name (atomic_write: a
    symbolic link at the name is replaced, never written through)."""
    path = root / "specs" / f"{name.replace(' ', '-').replace('(', '').replace(')', '')}.yaml"
    private_dir(path.parent, below=root, mode=0o755, what="smoke test's job specs directory")
    atomic_write(path, yaml.safe_dump(spec, sort_keys=False), durable=False)
    return path


class LocalRunner:
    """Each job through `hpcscale run --local`'s library call; its output goes to RUN/logs only."""

    def __init__(self, root: Path):
        self.root = root

    def __call__(self, name: str, spec: dict, run_dir: Path, reuse: bool) -> JobOutcome:
        from hpcscale.launch.local import run_local

        loaded = load_job(_spec_file(self.root, name, spec))
        result = run_local(loaded, ranks=None, run_dir=run_dir, reuse=reuse, echo=lambda _line: None)
        how = f"exit {result.exit_code}" + (f": {result.failure}" if result.failure else "")
        return JobOutcome(result.run_dir, result.exit_code == 0, how)


class SlurmRunner:
    """Each job through `hpcscale submit`'s library call, then polled (scontrol, sacct once it has left
    scontrol's memory) until it ends or `limit_s` passes (then cancelled)."""

    def __init__(self, root: Path, *, limit_s: float = 1800, poll_s: float = 2.0):
        self.root, self.limit_s, self.poll_s = root, limit_s, poll_s

    def __call__(self, name: str, spec: dict, run_dir: Path, reuse: bool) -> JobOutcome:
        from hpcscale.slurm.client import SlurmClient
        from hpcscale.slurm.submit import submit_job

        loaded = load_job(_spec_file(self.root, name, spec))
        client = SlurmClient.for_site(loaded.site.config)  # one for the submission and the polling
        result = submit_job(loaded, run_dir=run_dir, reuse=reuse, reason=f"smoke: {name}", client=client)
        state, code = self._wait(client, result.job_id or "")
        return JobOutcome(result.run_dir, state == "COMPLETED" and code.startswith("0:"), f"{state} {code}".strip())

    def _wait(self, client, job_id: str) -> tuple[str, str]:
        deadline = time.monotonic() + self.limit_s
        while True:
            state, code = _state(client, job_id)
            if state in TERMINAL:
                return state, code
            if time.monotonic() > deadline:
                client.run("scancel", job_id, check=False)
                return "TIMEOUT", f"(hpcscale smoke gave up after {self.limit_s:.0f} s and cancelled it)"
            time.sleep(self.poll_s)


def _state(client, job_id: str) -> tuple[str, str]:
    """The job's state word and exit code: scontrol while it knows the job, sacct after."""
    shown = client.show("job", job_id)
    if shown:
        return shown[0].get("JobState", "UNKNOWN"), shown[0].get("ExitCode", "")
    try:
        rows = client.sacct([job_id], ("State", "ExitCode"), "-X")
    except CommandFailed:
        rows = []
    if not rows:
        return "UNKNOWN", ""
    return (rows[-1]["State"].split() or ["UNKNOWN"])[0], rows[-1]["ExitCode"]

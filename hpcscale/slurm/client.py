"""Calls to Slurm's client commands for one site (its SLURM_CONF and cluster name applied)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcscale.config.site import SiteConfig
from hpcscale.util import proc
from hpcscale.util.paths import expand_path

SLURM_COMMANDS = ("sbatch", "srun", "squeue", "sacct", "scontrol", "sinfo")


@dataclass(frozen=True, slots=True)
class SlurmClient:
    """Runs Slurm commands the way this site needs them."""

    conf: str | None = None
    cluster: str | None = None

    @classmethod
    def for_site(cls, site: SiteConfig | None) -> SlurmClient:
        if site is None:
            return cls()
        conf = str(expand_path(site.slurm.conf)) if site.slurm.conf else None
        return cls(conf=conf, cluster=site.slurm.cluster)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": self.conf} if self.conf else {}

    def run(self, *args: str, timeout: float = 30, check: bool = True) -> proc.Completed:
        return proc.run(args, env=self.env, timeout=timeout, check=check)

    def ping(self) -> str:
        """scontrol ping's answer; CommandFailed when no controller answers."""
        out = self.run("scontrol", "ping", check=False, timeout=20)
        text = (out.stdout + out.stderr).strip()
        if out.returncode != 0 or "DOWN" in text or "UP" not in text:
            raise proc.CommandFailed(out.args, text or "no controller answered", out.returncode)
        return text

    def accounting(self) -> str:
        """A short sacct query; CommandFailed with sacct's words when accounting is off or down."""
        args = ["sacct", "-n", "-X", "-P", "-o", "JobID", "-S", "now"]
        if self.cluster:
            args += ["-M", self.cluster]
        out = self.run(*args, check=False, timeout=20)
        if out.returncode != 0 or "disabled" in out.stderr:
            raise proc.CommandFailed(out.args, out.stderr or out.stdout, out.returncode)
        return "sacct answers"

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

    def show(self, kind: str, name: str = "", *, timeout: float = 30) -> list[dict[str, str]]:
        """`scontrol show KIND [NAME] -o`, one dict of KEY=VALUE per record; [] when scontrol knows none.

        Values are split at whitespace, so a value with a space in it (a Reason, a path) is cut at the space."""
        out = self.run("scontrol", "show", kind, "-o", *([name] if name else []), check=False, timeout=timeout)
        return [dict(p.split("=", 1) for p in line.split() if "=" in p) for line in out.stdout.splitlines() if line]

    def config(self, *, timeout: float = 30) -> dict[str, str]:
        """`scontrol show config` as KEY -> VALUE; CommandFailed when no controller answers."""
        out = self.run("scontrol", "show", "config", timeout=timeout)
        pairs = (line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line)
        return {k.strip(): v.strip() for k, v in pairs}

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

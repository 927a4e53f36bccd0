"""Calls to Slurm's client commands for one site (its SLURM_CONF and cluster name applied).

A slurm.conf decides what Slurm's client commands load into their process (PluginDir=, the plugins, Include
files), so a site's `slurm.conf` is handed to them only when it is trusted (hpcscale.util.trust): a regular file,
owned by the user or root and writable by no one else, in a directory owned by the user or root that no one
else can write (or that is sticky). A symlink is resolved once and the file it leads to is checked and handed
to Slurm. Checked before every command, on descriptors; refused with exit 2 naming the file, its owner and
mode. A conf that does not exist is left to Slurm to report, once its directory is checked (nobody else can
create it there afterwards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpcscale.config.site import SiteConfig
from hpcscale.slurm import parse
from hpcscale.util import proc
from hpcscale.util.paths import expand_path
from hpcscale.util.trust import check_trusted

CONF_WHAT = "slurm.conf (the site's slurm.conf, given to Slurm as SLURM_CONF)"

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
        """The environment Slurm's commands get: SLURM_CONF, vetted (check_conf), when the site names one."""
        conf = self.check_conf()
        return {"SLURM_CONF": conf} if conf else {}

    def check_conf(self) -> str | None:
        """The site's slurm.conf as the path handed to Slurm, once trusted; UntrustedFile (exit 2) otherwise.

        A symlink is resolved first and the file it leads to is what is checked and handed over (a later swap
        of the link changes nothing); the file must be trusted and so must its directory (hpcscale.util.trust).
        A conf that does not exist is left to Slurm to report, once its directory is checked."""
        if not self.conf:
            return None
        conf = Path(os.path.realpath(self.conf))
        if os.path.lexists(conf):
            check_trusted(conf, what=CONF_WHAT, parent=True)
        elif conf.parent.is_dir():
            check_trusted(conf.parent, what=f"directory of the {CONF_WHAT}", directory=True)
        return str(conf)

    def run(self, *args: str, timeout: float = 30, check: bool = True, input: str | None = None) -> proc.Completed:
        return proc.run(args, env=self.env, timeout=timeout, check=check, input=input)

    def show(self, kind: str, name: str = "", *, timeout: float = 30) -> list[dict[str, str]]:
        """`scontrol show KIND [NAME]`, one dict of KEY=VALUE per record; [] when scontrol knows none.

        Jobs are read from the multi-line form (hpcscale.slurm.parse.scontrol_jobs): a job's name, working
        directory, comment and log paths come whole, spaces, `|` and `Key=` inside them included, and never
        change another key. Other kinds (partitions, nodes: what an administrator wrote) from `-o`, split at
        whitespace, so a value with a space in it is cut at the space."""
        if kind == "job":
            out = self.run("scontrol", "show", "job", *([name] if name else []), check=False, timeout=timeout)
            return parse.scontrol_jobs(out.stdout, name)
        out = self.run("scontrol", "show", kind, "-o", *([name] if name else []), check=False, timeout=timeout)
        return [dict(p.split("=", 1) for p in line.split() if "=" in p) for line in out.stdout.split("\n") if line]

    def sacct(self, job_ids: list[str], fields: tuple[str, ...], *args: str, timeout: float = 30) -> list[dict]:
        """sacct's rows for `job_ids` (`args`: more options, e.g. -X, -D), field -> value, read as
        hpcscale.slurm.parse says (at most one field a user chooses, last). CommandFailed with sacct's words
        when it fails or accounting is off."""
        cmd = ["sacct", *args, "-j", ",".join(job_ids), *parse.sacct_args(fields)]
        if self.cluster:
            cmd += ["-M", self.cluster]
        out = self.run(*cmd, timeout=timeout)
        if "disabled" in out.stderr:
            raise proc.CommandFailed(out.args, out.stderr)
        return parse.sacct_rows(out.stdout, fields)

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

"""`hpcscale render` and `hpcscale submit`: the library behind them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from hpcscale.config.load import LoadedJob
from hpcscale.rundir import JOB, RunDir, Submission, default_run_dir
from hpcscale.slurm.allocation import site_tree
from hpcscale.slurm.client import SlurmClient
from hpcscale.slurm.render import choose_template, render_chosen, render_script
from hpcscale.slurm.resolve import ResolvedJob, resolve
from hpcscale.util import proc
from hpcscale.util.paths import expand_path


@dataclass(frozen=True, slots=True)
class SubmitResult:
    job_id: str | None
    cluster: str | None
    run_dir: Path
    script: Path
    template: str
    switches: int | None
    dry_run: bool


def resolve_for_slurm(
    loaded: LoadedJob,
    *,
    run_dir: Path | None,
    excluded: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    client: SlurmClient | None = None,
) -> ResolvedJob:
    site = loaded.site.config
    if run_dir is None:
        run_dir = default_run_dir(expand_path(site.filesystems.run_root), loaded.spec.name)
    client = client or SlurmClient.for_site(site)
    tree = site_tree(site, client) if site.scheduler == "slurm" else None
    return resolve(loaded, run_dir=run_dir.resolve(), tree=tree, excluded=excluded, required=required)


def render_job(loaded: LoadedJob, *, run_dir: Path | None = None, template: str | None = None) -> str:
    return render_script(resolve_for_slurm(loaded, run_dir=run_dir), template)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A submission resolved and rendered, before anything touches the disk or Slurm: what `resume --dry-run`
    shows is what submit_job then sends, built once."""

    client: SlurmClient
    job: ResolvedJob
    template: str  # the template's name, as choose_template picked it
    script: str  # the sbatch script, as rendered from it


def prepare(
    loaded: LoadedJob,
    *,
    run_dir: Path | None,
    template: str | None = None,
    excluded: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    client: SlurmClient | None = None,
) -> Prepared:
    """Resolve the job against the site (and its switch tree, through `client`), choose its template and
    render the script."""
    client = client or SlurmClient.for_site(loaded.site.config)
    job = resolve_for_slurm(loaded, run_dir=run_dir, excluded=excluded, required=required, client=client)
    name = choose_template(job, template)
    return Prepared(client, job, name, render_chosen(job, name))


def submit_job(
    loaded: LoadedJob,
    *,
    run_dir: Path | None = None,
    template: str | None = None,
    dry_run: bool = False,
    reuse: bool = False,
    excluded: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    reason: str = "submit",
    client: SlurmClient | None = None,
    prepared: Prepared | None = None,
) -> SubmitResult:
    """Render, create the run directory, sbatch --parsable, record. Slurm's refusal is a CommandFailed
    carrying sbatch's own message; a run directory created by this call is then removed again.

    `client`: the caller's Slurm client (else one for the job's site); `prepared`: the submission the caller
    already resolved and rendered (prepare), sent as it is: run_dir, template, excluded, required and client
    are then its own."""
    if prepared is None:  # rendered before touching the disk: a bad template leaves nothing behind
        prepared = prepare(
            loaded, run_dir=run_dir, template=template, excluded=excluded, required=required, client=client
        )
    client, job, name, text = prepared.client, prepared.job, prepared.template, prepared.script
    existed = job.run_dir.exists()
    rd = RunDir.create(job.run_dir, reuse=reuse)
    index = rd.next_index()
    overrides = [o.text for o in loaded.overrides]
    if not overrides and loaded.path.resolve() == (rd.path / JOB).resolve():
        overrides = rd.recorded_overrides()  # a resume resubmits the recorded spec: keep saying where it came from
    try:
        rd.write_resolved(job.spec, job.site, overrides=overrides)
        script = rd.write_script(index, text)
        job_id = cluster = None
        if not dry_run:
            # The script on stdin, as rendered: sbatch opening RUN/submissions/NNNN.sbatch by name would read
            # whatever a co-user who can write RUN renamed there after it was written (the file is the record).
            out = client.run("sbatch", "--parsable", timeout=60, input=text).stdout.strip()
            job_id, _, cluster = out.partition(";")
            cluster = cluster or job.site.slurm.cluster
            rd.record(
                Submission(
                    index=index,
                    job_id=job_id,
                    cluster=cluster or None,
                    time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    script=str(script.relative_to(rd.path)),
                    template=name,
                    excluded=list(job.excluded),
                    reason=reason,
                )
            )
    except proc.CommandFailed:
        if not existed:
            rd.discard()
        raise
    return SubmitResult(job_id, cluster or None, rd.path, script, name, job.switches, dry_run)

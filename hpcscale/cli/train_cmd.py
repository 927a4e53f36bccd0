"""`hpcscale launch`, `hpcscale run --local`, `hpcscale data prepare`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcscale.cli.options import json_option, load_job_warning, param_option, print_json, site_option
from hpcscale.errors import STOPPED_EXIT_CODE


@click.command()
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    help="The run directory hpcscale submit/run created.",
)
@click.option("--sweep-index", type=int, default=None, help="Array task index of a sweep (set by the array template).")
def launch(run_dir: Path, sweep_index: int | None) -> None:
    """Run one rank of a job: started by srun or mpirun, never by hand.

    \b
    In an sbatch script:
      srun --mpi=pmix --kill-on-bad-exit=1 hpcscale launch --run-dir "$RUN"

    Exit codes: 0 done, 75 stopped on request (SIGUSR1/SIGUSR2/SIGTERM; resume later), 1 failure.
    """
    from hpcscale.launch.main import launch as run_rank
    from hpcscale.launch.scheduler import SchedulerView
    from hpcscale.slurm.allocation import job_log_paths, site_tree
    from hpcscale.slurm.health import job_signs

    # the ranks read the scheduler through these three, and import nothing of hpcscale.slurm themselves
    scheduler = SchedulerView(switch_tree=site_tree, log_paths=job_log_paths, signs=job_signs)
    sys.exit(run_rank(run_dir, sweep_index=sweep_index, scheduler=scheduler))


@click.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--local", "local", is_flag=True, required=True, help="Run on this machine through mpirun (no Slurm).")
@click.option("-n", "ranks", type=int, default=None, help="Number of ranks (default: the job's nodes x tasks).")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Run directory (default: <site run_root>/<job name>-<UTC time>).",
)
@click.option(
    "--reuse", is_flag=True, help="Run again in an existing run directory: resumes from its newest checkpoint."
)
@site_option
@param_option
def run(
    job: str,
    local: bool,
    ranks: int | None,
    run_dir: Path | None,
    reuse: bool,
    site: str | None,
    params: tuple[str, ...],
) -> None:
    """Run JOB on this machine through mpirun, writing the same run directory a Slurm job writes.

    \b
    Example (the reference GPT, tp=2 x pp=2 x dp=2):
      hpcscale run docs/examples/gpt-local.yaml --local -n 8
      hpcscale run docs/examples/gpt-local.yaml --local -n 8 -p train.params.lr=3e-4 -p train.params.steps=50
      hpcscale run job.yaml --local --run-dir RUN --reuse     # resume RUN from its newest checkpoint

    SIGTERM, SIGHUP or Ctrl-C stops every rank after the same step, with a checkpoint; a second one stops
    them at once. Nothing of the run outlives the command, even if it is killed.

    Exit codes: 0 done, 75 stopped on request, 2 a rank refused its input (a BadInput: the job spec, an
    argument of the entry point's; named in the message), 1 a rank failed otherwise (named in the message).
    """
    from hpcscale.launch.local import run_local

    result = run_local(
        load_job_warning(job, site, params),
        ranks=ranks,
        run_dir=run_dir,
        reuse=reuse,
        echo=click.echo,
        warn=lambda line: click.echo(line, err=True),
    )
    click.echo(f"run directory: {result.run_dir}", err=True)
    if (outcome := _outcome(result)) is not None:
        click.echo(outcome, err=True)
    sys.exit(_exit_code(result))


def _exit_code(result) -> int:
    if result.exit_code in (0, STOPPED_EXIT_CODE):
        return result.exit_code
    # 2: a rank refused its input and called MPI_Abort(2), which mpirun passes on; its line names it
    return 2 if result.exit_code == 2 and result.failure else 1


def _outcome(result) -> str | None:
    """The last line, unless the run simply finished: how it ended, and the rank to blame if one failed."""
    if result.stopped_by is not None and result.exit_code == STOPPED_EXIT_CODE:
        # "every rank stopped" only when mpirun itself exited 75 (every rank did) and nothing was forced
        if result.forced:
            how = "the ranks were terminated before they stopped"
        elif result.failure:
            how = f"not every rank stopped cleanly: {result.failure}"
        else:
            how = "every rank stopped at the same step"
        return f"stopped on {result.stopped_by}: {how}; resume with --reuse (exit 75)"
    if result.exit_code == 0:
        return None
    if result.exit_code == STOPPED_EXIT_CODE:
        return "stopped on request: every rank stopped at the same step; resume with --reuse (exit 75)"
    return f"error: the job failed (exit {result.exit_code})" + (f": {result.failure}" if result.failure else "")


@click.group()
def data() -> None:
    """Datasets for the reference trainer."""


@data.command()
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="New dataset directory.")
@click.option("--seq-len", type=int, default=256, show_default=True, help="Longest seq_len the data will serve.")
@click.option("--shard-samples", type=int, default=4096, show_default=True, help="Samples per shard file.")
@click.option("--max-mb", type=float, default=None, help="Stop after this many MB of text.")
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of the document order (training holds out the last samples: a seeded sample of whole documents).",
)
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path),
    default=None,
    help="A Hugging Face tokenizers file (tokenizer.json); default: bytes.",
)
@json_option
def prepare(
    src: Path,
    out: Path,
    seq_len: int,
    shard_samples: int,
    max_mb: float | None,
    seed: int,
    tokenizer: Path | None,
    as_json: bool,
) -> None:
    """Turn a text corpus (a file, or every text file under a directory) into token shards and a manifest:
    byte-level tokens, or a local tokenizers file's (copied into the dataset and hashed in the manifest).

    \b
    Example:
      hpcscale data prepare /usr/lib/python3.11 --out data/pystdlib
      hpcscale data prepare corpus/ --tokenizer tokenizer.json --out data/corpus-bpe
    """
    from hpcscale.data.prepare import prepare as run_prepare

    m = run_prepare(
        src,
        out,
        sample_len=seq_len + 1,
        shard_samples=shard_samples,
        max_bytes=int(max_mb * 2**20) if max_mb else None,
        tokenizer=tokenizer,
        seed=seed,
    )
    doc = {
        "out": str(out),
        "manifest": str(out / "manifest.json"),
        "shards": len(m.dataset.shards),
        "samples": m.dataset.samples,
        "sample_len": m.dataset.sample_len,
        "vocab_size": m.dataset.vocab_size,
        "dtype": m.dataset.dtype,
        "tokenizer": m.meta.get("tokenizer"),
        "documents": m.meta["documents"],
        "document_order": m.meta["document_order"],
        "bytes": sum(f.size for f in m.files),
    }
    if as_json:
        print_json(doc)
    else:
        click.echo(
            f"{doc['samples']} samples of {doc['sample_len']} tokens in {doc['shards']} shards -> {doc['manifest']}"
        )

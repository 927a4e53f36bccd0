"""The `hpcscale` click group. Commands are loaded only when invoked, so `--help` stays fast on login nodes.
The console script starts at hpcscale.cli.entry:main, which may start ssh before this module loads."""

from __future__ import annotations

import importlib
import sys

import click

from hpcscale import __version__

# name -> (module, attribute, one-line help shown by `hpcscale --help` without importing the module)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "config": ("hpcscale.cli.config_cmd", "config", "Validate site configs and job specs; show a site."),
    "doctor": ("hpcscale.cli.doctor_cmd", "doctor", "Check Slurm, MPI, torch and the filesystem; say how to fix."),
    "smoke": ("hpcscale.cli.smoke_cmd", "smoke", "Check new GPU nodes with real jobs: devices, NCCL, train, resume."),
    "render": ("hpcscale.cli.slurm_cmd", "render", "Print the sbatch script for a job; submit nothing."),
    "submit": ("hpcscale.cli.slurm_cmd", "submit", "Render, create the run directory and sbatch a job."),
    "status": ("hpcscale.cli.slurm_cmd", "status", "A run's submissions and their Slurm states."),
    "report": ("hpcscale.cli.report_cmd", "report", "Plots and a summary of a run: loss, throughput, per-rank time."),
    "resume": ("hpcscale.cli.resume_cmd", "resume", "Explain how a run stopped; resubmit from a verified checkpoint."),
    "requeue": ("hpcscale.cli.resume_cmd", "requeue", "In a batch script, after the ranks: requeue the job or not."),
    "step-nodes": (
        "hpcscale.cli.resume_cmd",
        "step_nodes",
        "In a batch script with spare nodes: the nodes its first step runs on.",
    ),
    "topo": ("hpcscale.cli.topo_cmd", "topo", "Show the switch tree; plan rank placement."),
    "run": ("hpcscale.cli.train_cmd", "run", "Run a job on this machine through mpirun (--local)."),
    "launch": ("hpcscale.cli.train_cmd", "launch", "One rank of a job, under srun or mpirun."),
    "data": ("hpcscale.cli.train_cmd", "data", "Prepare token datasets from text."),
    "ckpt": ("hpcscale.cli.ckpt_cmd", "ckpt", "List, verify, inspect, gc and export checkpoints."),
    "manifest": ("hpcscale.cli.stage_cmd", "manifest", "Build, diff and verify dataset manifests."),
    "sync": ("hpcscale.cli.sync_cmd", "sync", "One cross-site round tick (cron); status; keys."),
    "stage": (
        "hpcscale.cli.stage_cmd",
        "stage",
        "Copy a manifest's files between sites: verified, resumable, parallel.",
    ),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use, and which maps hpcscale's errors to
    exit codes (1 runtime, 2 bad input, 3 verification) without tracebacks."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["hpcscale.json"] = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        from hpcscale.errors import HpcscaleError

        try:
            return super().invoke(ctx)
        except click.ClickException as e:  # a bad option or argument: click's own message, and JSON when asked
            _json_error(ctx, e.format_message(), e.exit_code)
            raise
        except HpcscaleError as e:
            from hpcscale.util.trust import clean

            # An error may quote a file's or a remote's words: shown without their control characters.
            text = clean(str(e), limit=20_000, newlines=True)
            click.echo(f"error: {text}" if e.exit_code != 2 else text, err=True)
            _json_error(ctx, text, e.exit_code)
            sys.exit(e.exit_code)


def _json_error(ctx: click.Context, text: str, code: int) -> None:
    """A script that asked for JSON (--json) gets one JSON document, failures included: the command's own report
    when it wrote one before failing (verify's list of bad files), else the message and the exit code."""
    if ctx.meta.get("hpcscale.json") and not ctx.meta.get("hpcscale.json_written"):
        from hpcscale.cli.options import print_json

        print_json({"error": text, "exit_code": code})


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="hpcscale")
@click.option("-v", "--verbose", is_flag=True, help="Log every external command run.")
def cli(verbose: bool) -> None:
    """hpcscale: train large models on Slurm clusters and across sites.

    \b
    Examples:
      hpcscale doctor --site localcluster
      hpcscale config validate site_configs/*.yaml docs/examples/*.yaml
      hpcscale config show localcluster
      hpcscale render job.yaml
      hpcscale submit job.yaml && hpcscale status <run dir>

    Exit codes: 0 success, 1 runtime failure, 2 bad input, 3 verification failure, 75 stopped on request
    (run, launch, resume: the last step checkpointed).
    """
    if verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s")

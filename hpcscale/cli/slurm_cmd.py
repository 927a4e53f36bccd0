"""`hpcscale render`, `submit`, `status`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcscale.cli.options import (
    console,
    dry_run_option,
    json_option,
    load_job_warning,
    param_option,
    print_json,
    site_option,
)
from hpcscale.observe.timing import human_bytes

job_argument = click.argument("job", type=click.Path(dir_okay=False))
run_dir_option = click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Run directory (default: <site run_root>/<job name>-<UTC time>).",
)
template_option = click.option(
    "--template", default=None, metavar="T", help="Built-in template (default, container, array) or a path to your own."
)


@click.command()
@job_argument
@site_option
@template_option
@run_dir_option
@param_option
def render(job: str, site: str | None, template: str | None, run_dir: Path | None, params: tuple[str, ...]) -> None:
    """Print the sbatch script for JOB; nothing is submitted or written.

    \b
    Examples:
      hpcscale render job.yaml
      hpcscale render job.yaml --site localcluster --template container > job.sbatch
      hpcscale render job.yaml -p nodes=4 -p time_limit=02:00:00
    """
    from hpcscale.slurm.submit import render_job

    text = render_job(load_job_warning(job, site, params), run_dir=run_dir, template=template)
    if sys.stdout.isatty():
        from rich.syntax import Syntax

        console().print(Syntax(text, "bash"))
    else:
        sys.stdout.write(text)


@click.command()
@job_argument
@site_option
@template_option
@run_dir_option
@click.option("--reuse", is_flag=True, help="Add this submission to an existing run directory.")
@param_option
@dry_run_option
@json_option
def submit(
    job: str,
    site: str | None,
    template: str | None,
    run_dir: Path | None,
    reuse: bool,
    params: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
) -> None:
    """Render JOB, create its run directory, and submit it with sbatch; prints the job id.

    \b
    Examples:
      hpcscale submit job.yaml
      hpcscale submit job.yaml --run-dir /scratch/me/runs/exp1 --json
      hpcscale submit job.yaml --dry-run     # everything but sbatch
      hpcscale submit job.yaml -p train.params.lr=3e-4 -p nodes=4   # recorded in RUN/job.yaml

    Slurm's refusal is printed verbatim (exit 1).
    """
    from hpcscale.slurm.submit import submit_job

    loaded = load_job_warning(job, site, params)
    r = submit_job(loaded, run_dir=run_dir, template=template, dry_run=dry_run, reuse=reuse)
    if as_json:
        print_json(
            {
                "job_id": r.job_id,
                "cluster": r.cluster,
                "run_dir": str(r.run_dir),
                "script": str(r.script),
                "template": r.template,
                "switches": r.switches,
                "dry_run": r.dry_run,
            }
        )
    elif dry_run:
        click.echo(f"dry run: script written to {r.script} (not submitted)")
    else:
        click.echo(r.job_id)
        click.echo(f"run directory: {r.run_dir}", err=True)


def _sign_lines(rows: list[dict]) -> list[str]:
    """`warning sign` lines: what Slurm and the GPUs showed of the job's nodes (health signals), and the
    checkpoints they caused."""
    from hpcscale.util.trust import clean_markup as cm

    out = []
    for row in rows:
        step = cm(row.get("step"), limit=20)
        if "health_checkpoint" in row:
            c = row["health_checkpoint"]
            out.append(f"  step {step}: {cm(c.get('tier'), limit=20)} checkpoint {cm(c.get('step'), limit=20)} taken")
            continue
        for sign in row["health"]:
            where = f" on {cm(sign.get('node'), limit=60)}" if sign.get("node") else ""
            out.append(
                f"  step {step}: {cm(sign.get('kind'), limit=30)}{where} ({cm(sign.get('evidence'), limit=300)})"
            )
    return ["warning signs:", *out] if out else []


def _efficiency_line(m: dict, flops: dict | None) -> str | None:
    """`efficiency:` MFU and TFLOPS per device of the last step, the model FLOPs and how they were found, and
    the memory peaks (docs/observability.md#efficiency); None when the run logged none of them."""
    from hpcscale.util.trust import clean_markup

    def cm(value: object, limit: int) -> str:
        return clean_markup(value, limit=limit)

    parts = []
    if "mfu" in m:
        parts.append(f"MFU {_num(m['mfu'], '.1f', scale=100)} %")
    if "tflops" in m:
        parts.append(f"{_num(m['tflops'], '.4g')} TFLOPS per device")
    if isinstance(flops, dict):
        peak = flops.get("peak_tflops")
        device = cm(flops.get("device"), 80)
        if peak is not None:
            parts.append(f"peak {_num(peak, '.4g')} TFLOPS per {device} ({cm(flops.get('peak_source'), 20)})")
        else:
            parts.append(f"no peak known for {device}")
        per_token = flops.get("flops_per_token")
        if flops.get("flops_per_step") is None:
            parts.append(f"model FLOPs not known ({cm(flops.get('why'), 200)})")
        elif per_token is not None:
            parts.append(f"{_num(per_token, '.4g', scale=1e-9)} GFLOP per token ({cm(flops.get('source'), 20)})")
        else:
            step = flops.get("flops_per_step")
            parts.append(f"{_num(step, '.4g', scale=1e-12)} TFLOP per step ({cm(flops.get('source'), 20)})")
    if isinstance(flops, dict) and isinstance(flops.get("energy"), str) and flops["energy"] != "measured (NVML)":
        parts.append(f"energy {cm(flops['energy'], 200)}")
    if "power_w" in m:
        gpu = f"GPU {_num(m['power_w'], '.0f')} W"
        if "gpu_util" in m:
            gpu += f", {_num(m['gpu_util'], '.0f')} % busy"
        if "sm_clock_mhz" in m:
            gpu += f", SM {_num(m['sm_clock_mhz'], '.0f')} MHz"
        if isinstance(m.get("throttle"), list) and m["throttle"]:
            gpu += f", clocks held down: {cm(','.join(map(str, m['throttle'][:6])), 120)}"
        parts.append(gpu)
    if "mem_gb" in m:
        parts.append(
            f"device memory peak {_num(m['mem_gb'], '.2f')} GB ({_num(m.get('mem_reserved_gb'), '.2f')} reserved)"
        )
    if "rss_gb" in m:
        parts.append(f"host memory peak {_num(m['rss_gb'], '.2f')} GB")
    return "efficiency: " + ", ".join(parts) if parts else None


def _num(value, fmt: str, scale: float = 1.0) -> str:
    """A figure from a run's files (times `scale`), formatted when it is a finite number; shown as found
    (cleaned) otherwise."""
    import math

    from hpcscale.util.trust import clean_markup

    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            if math.isfinite(value):  # an integer beyond any float: OverflowError
                return format(value * scale, fmt)
        except (ValueError, OverflowError):
            pass
    return clean_markup(repr(value), limit=60)


STATE_COLORS = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow", "REQUEUED": "yellow"}
NODES_WIDTH = 16  # a longer node list folds in its column; the whole list is in --json


def format_status(status) -> list:
    """A run's submissions, each Slurm job's starts (attempts) and how each ended: a heading, a narrow table (one
    row per attempt), then the long text as numbered lines below it (each submission's time and reason, each
    attempt's cause in words), so that the table reads in a pipe or an 80-column terminal and no reason is cut
    or folded. Every string from the run directory or from Slurm is shown through clean_markup: no escape
    sequence reaches the terminal and no `[link=...]` becomes markup."""
    from rich import box
    from rich.table import Table

    from hpcscale.util.trust import clean_markup as c

    heading = f"{c(status.job_name or 'run', limit=200)} — {c(status.run_dir)} (states from {c(status.source)})"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for col in ("#", "job", "attempt", "state", "exit", "nodes", "elapsed", "see"):
        table.add_column(col, overflow="fold", max_width=NODES_WIDTH if col in ("job", "nodes") else None)
    below: list[str] = []
    refs = 0
    for s in status.submissions:
        sub = s.submission
        excluded = f" (excluded {','.join(sub.excluded)})" if sub.excluded else ""
        below.append(f"#{sub.index} submitted {c(sub.time)}: {c(sub.reason + excluded, limit=2000)}")
        first = True
        for job in s.jobs or [None]:
            attempts = (job.attempts or [None]) if job else [None]
            if job and job.attempts_left_out:
                below.append(f"  job {c(job.job_id)}: {job.attempts_left_out} older attempt(s) not shown")
            for a in attempts:
                ref = ""
                if a is not None and a.summary and a.cause != "completed":
                    refs += 1
                    ref = f"[{refs}]"  # not a markup tag: rich's begin with a letter, #, / or @
                    what = f"attempt {a.attempt}, " if a.attempt is not None else ""
                    below.append(f"{ref} job {c(job.job_id)}, {what}restart {a.restart}: {c(a.summary, limit=2000)}")
                table.add_row(
                    str(sub.index) if first else "",
                    c(job.job_id if job else (sub.job_id or "dry run")),
                    "-" if a is None or a.attempt is None else str(a.attempt),
                    _state_cell(a, job),
                    c(a.exit_code if a else (job.exit_code if job else "")),
                    c(a.nodes if a else (job.nodes if job else "")),
                    c(a.elapsed if a else (job.elapsed if job else "")),
                    ref,
                )
                first = False
    return [heading, table, "", *below]


def _state_cell(attempt, job) -> str:
    """Slurm's state, colored; during a requeue's backoff (Slurm still says RUNNING) how the attempt ended and
    that the requeue waits, with the seconds left."""
    from hpcscale.util.trust import clean_markup as c

    if attempt is None:
        state = job.state if job else "-"
    elif attempt.waiting:
        cause = (attempt.cause or "ended").replace("_", " ").upper()
        n = attempt.requeue_in_s
        state = f"{cause}, requeue " + ("waits" if n is None else f"in {n} s" if n >= 0 else "due")
        return f"[red]{c(state)}[/red]"
    else:
        state = attempt.state
    word = state.split()[0] if state else ""
    color = STATE_COLORS.get(word, "red" if job and word not in ("-", "") else "")
    return f"[{color}]{c(state)}[/{color}]" if color else c(state)


@click.command()
@click.argument("run", type=click.Path(file_okay=False, exists=True, path_type=Path))
@json_option
def status(run: Path, as_json: bool) -> None:
    """Show a run's submissions with their Slurm states, exit codes, nodes and elapsed time.

    \b
    Example:
      hpcscale status /scratch/me/runs/gpt-20261121-101500 --json
    """
    from hpcscale.slurm.status import run_status
    from hpcscale.util.trust import clean_markup as cm

    st = run_status(run)
    if as_json:
        print_json(st.to_json())
        return
    out = console()
    for line in format_status(st):
        out.print(line)
    if st.latest_checkpoint:
        c = st.latest_checkpoint
        out.print(
            f"latest checkpoint: step {cm(c['step'])} ({cm(c['path'])}), layout {cm(c['layout'])}, {cm(c['verified'])}"
        )
    if st.last_metrics:
        m = st.last_metrics
        # a user loop's line has what it logged, and hpcscale's step time (tokens/s once it gives tokens_per_step)
        pace = f", {_num(m['step_time_s'], '.1f', scale=1000)} ms/step" if "step_time_s" in m else ""
        rate = f", {_num(m['tokens_per_s'], '.0f')} tokens/s" if "tokens_per_s" in m else ""
        out.print(f"last step {cm(m.get('step'))}: loss {_num(m.get('loss'), '.4f')}{pace}{rate}")
    line = _efficiency_line(st.last_metrics or {}, st.model_flops)
    if line:
        out.print(line)
    for line in _sign_lines(st.signs):
        out.print(line)
    if st.timing:
        for line in format_timing(st.timing, run) + format_traffic(st.timing):
            out.print(line)
    if st.checkpoint_interval:
        c = st.checkpoint_interval
        out.print(
            f"checkpoint interval (auto): {cm(c.get('steps'))} steps, next save at step {cm(c.get('next_at'))}: "
            f"{cm(c.get('why'), limit=500)}"
        )
    for note in st.notes:
        out.print(f"[yellow]note[/yellow]: {cm(note)}")


PER_RANK_ROWS = 16  # up to this many ranks, a row each; above, a row per node and the slowest ranks


def format_timing(timing: dict, run: Path) -> list:
    """The newest per-rank window as a table (per node for big jobs) and the straggler verdict
    (docs/observability.md explains every column)."""
    from rich.table import Table

    from hpcscale.util.trust import clean_markup as cm

    verdict = timing["stragglers"]
    relative = {r["rank"]: r for r in verdict["ranks"]}
    ranks = timing["ranks"]
    title = f"per-rank step time, ms: means over steps {timing['step'] - timing['steps'] + 1}-{timing['step']}" + (
        f" (attempt {timing['attempt']})" if timing["attempt"] is not None else ""
    )
    table = Table(title=title)
    columns = ("step_s", "own_s", "compute_s", "data_s", "dp_wait_s", "sync_s", "comm_s", "ckpt_s")
    heads = ("step", "own", "compute", "data", "dp wait", "step sync", "comm wait", "ckpt")
    per_rank = len(ranks) <= PER_RANK_ROWS
    for col in ("rank" if per_rank else "node", "node" if per_rank else "ranks", "pp", *heads, "own ÷ peers"):
        table.add_column(col, justify="right" if col not in ("node", "ranks") else "left")
    if per_rank:
        rows = [
            (str(r["rank"]), cm(r["node"]), str(r["pp"]), r, relative.get(r["rank"], {}).get("relative")) for r in ranks
        ]
    else:
        import statistics

        by_node: dict[str, list[dict]] = {}
        for r in ranks:
            by_node.setdefault(r["node"], []).append(r)
        rows = []
        for node, members in by_node.items():
            med = {c: statistics.median(m.get(c, 0.0) for m in members) for c in columns}
            stages = sorted({m["pp"] for m in members})
            first, last = members[0]["rank"], members[-1]["rank"]
            rows.append((node, f"{first}-{last}", ",".join(map(str, stages)), med, verdict["nodes"].get(node)))
    slow = set(verdict["slow_ranks"])
    slow_nodes = set(verdict["slow_nodes"])
    for a, b, pp, figures, rel in rows:
        flagged = (per_rank and int(a) in slow) or (not per_rank and a in slow_nodes)
        if not per_rank:
            a = cm(a)
        cells = [f"{figures.get(c, 0.0) * 1000:.1f}" for c in columns]  # comm_s: absent from older windows
        mark = "—" if rel is None else f"{rel:.2f}×"
        row = [a, b, pp, *cells, mark]
        table.add_row(*[f"[red]{x}[/red]" for x in row] if flagged else row)
    lines: list = [table]
    rule = verdict["rule"]
    if verdict["reason"]:
        lines.append(f"stragglers: no verdict: {verdict['reason']}")
    elif not slow:
        lines.append(
            f"stragglers: none (no rank's own time was ≥ {rule['ratio']}× its peers' in {rule['min_slow']} of the "
            f"last {verdict['windows']} windows)"
        )
    else:
        for rank in verdict["slow_ranks"]:
            r = relative[rank]
            lines.append(
                f"[red]straggler: rank {rank} on node {cm(r['node'])}[/red]: own time {r['relative']:.2f}× its peers' "
                f"(slow in {r['slow_windows']} of the last {verdict['windows']} windows)"
            )
        nodes = cm(",".join(verdict["slow_nodes"]))
        lines.append(
            f"slow node(s): {nodes}. To move the job off them: stop it (scancel --signal=USR2 JOBID: it saves and "
            f"stops), then hpcscale resume {cm(run)} --exclude-slow"
        )
    return lines


def format_traffic(timing: dict) -> list:
    """The newest window's traffic per process group (the communication ledger) and the late-arrival verdict
    (docs/observability.md); nothing for a run recorded without the ledger."""
    from rich.table import Table

    from hpcscale.util.trust import clean_markup as cm

    groups = timing.get("traffic") or []
    if not groups:
        return []
    table = Table(
        title=f"communication per step, steps {timing['step'] - timing['steps'] + 1}-{timing['step']} "
        "(each group: the median of its ranks' means)"
    )
    for col in ("group", "ranks", "bytes/step", "by kind (bytes × collectives)", "blocked ms", "GB/s blocked"):
        table.add_column(col, justify="left" if col in ("group", "by kind (bytes × collectives)") else "right")
    for g in groups:
        kinds = ", ".join(
            f"{cm(kind)} {human_bytes(k['bytes'])} × {k['n']:g}" for kind, k in sorted(g["kinds"].items()) if k["n"] > 0
        )
        spread = "" if g["bytes_max"] <= g["bytes"] * 1.001 else f" (max {human_bytes(g['bytes_max'])})"
        table.add_row(
            cm(g["group"]),
            str(g["ranks"]),
            human_bytes(g["bytes"]) + spread,
            kinds,
            f"{g['wait_s'] * 1000:.1f}",
            "—" if g["gbps"] is None else f"{g['gbps']:.2f}",
        )
    lines: list = [table]
    late = timing.get("late")
    if not late:
        return lines
    rule = late["rule"]
    if late["reason"]:
        lines.append(f"late arrivals: no verdict: {late['reason']}")
    elif not late["slow_ranks"]:
        lines.append(
            f"late arrivals: none (no rank entered a group's collectives ≥ {rule['ratio']}× later than its peers "
            f"and ≥ {rule['floor_s'] * 1000:g} ms and {rule.get('share', 0) * 100:g} % of its step, per step, in "
            f"{rule['min_slow']} of the last {late['windows']} "
            "windows)"
        )
    else:
        by_rank = {r["rank"]: r for r in late["ranks"]}
        for rank in late["slow_ranks"]:
            r = by_rank[rank]
            lines.append(
                f"[red]late arrival: rank {rank} on node {cm(r['node'])}[/red]: the others waited for it at "
                f"{cm(', '.join(r['groups']))} collectives, {r['late_s'] * 1000:.1f} ms per step "
                f"(in {r['late_windows']} of the last {late['windows']} windows)"
            )
    return lines

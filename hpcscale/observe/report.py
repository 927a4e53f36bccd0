"""`hpcscale report RUN -o DIR`: PNG plots and a markdown summary of a run, from its files alone (docs/report.md).

Reads RUN/metrics.jsonl (loss, validation loss, step time, tokens/s, saves), RUN/attempts.jsonl (restarts),
RUN/timing.jsonl (per-rank step times, stragglers) and the committed checkpoints. Torch-free: a login node
makes the report. Damaged or torn lines are skipped, never fatal; a step logged again after a restart keeps
its newest value (the one training went on from).

Writes, inside DIR only: loss.png, throughput.png, efficiency.png (when the run logged efficiency figures), ranks.png
(when per-rank timing exists), summary.md. DIR is
opened once (O_NOFOLLOW|O_DIRECTORY: a symlink there is refused) and every file is written relative to that
descriptor through a temporary of a random name (O_CREAT|O_EXCL|O_NOFOLLOW), then renamed: swapping DIR, or
planting symlinks in it, cannot make the report write elsewhere.

Bounded whatever the run directory holds (others may write it): metrics.jsonl's last METRICS_TAIL bytes are
read (the summary says how much was left out), timing.jsonl as hpcscale.observe.timing bounds it, a file that is
not a regular file (a FIFO, a device) is refused (metrics) or skipped (timing, job.yaml's name); a figure that
is not a number or not finite (or beyond MAX_FIGURE) is not plotted; the per-rank heatmap has at most
PLOT_ROWS rows (ranks binned, each bin showing its slowest rank). Text from the run (its name) is cleaned of
control characters.
"""

from __future__ import annotations

import errno
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from hpcscale.errors import BadInput
from hpcscale.observe.downtime import relaunch_downtimes
from hpcscale.observe.timing import human_bytes
from hpcscale.portable.files import atomic_write
from hpcscale.rundir import JOB, METRICS, TIMING, RunDir
from hpcscale.util.bounded import loads_json, read_bounded, read_tail
from hpcscale.util.trust import check_dir_fd, clean

MAX_LINE = 1 << 20
METRICS_TAIL = 64 << 20  # bytes of metrics.jsonl read (its end): ~300k steps
MAX_FIGURE = 1e100  # a figure beyond this is not plotted (matplotlib's transforms overflow near 1e308)
PLOT_ROWS = 128  # rows of the per-rank heatmap; more ranks are binned
MAX_STEP = 10**15  # a step number beyond this is damage, not a step
EFFICIENCY = ("tflops", "mfu", "mem_gb", "mem_reserved_gb", "rss_gb", "power_w")  # docs/observability.md#efficiency
KEPT = ("loss", "tokens_per_s", "step_time_s", "time", "attempt", *EFFICIENCY)  # what is kept of a training line
TIMED = ("tokens_per_s", "step_time_s", *EFFICIENCY)  # what ctx.checkpoint.step adds to a user loop's line


@dataclass
class RunData:
    name: str
    train: dict[int, dict] = field(default_factory=dict)  # step -> newest training line
    val: dict[int, float] = field(default_factory=dict)  # step -> newest validation loss
    saves: list[tuple[int, float, int | None]] = field(default_factory=list)  # (step saved, time, attempt)
    restarts: list[tuple[int, float, int]] = field(default_factory=list)  # (first step, time, attempt)
    attempts: int = 0
    # attempt -> how long training stopped when it was relaunched in its allocation (hpcscale.observe.downtime)
    relaunches: dict[int, dict] = field(default_factory=dict)
    model_flops: dict | None = None  # the newest model FLOPs record (efficiency)
    usage: dict = field(default_factory=dict)  # node-hours and GPU-hours over the attempts (usage())
    skipped: int = 0  # lines that were not JSON objects
    cut_bytes: int = 0  # bytes at the start of metrics.jsonl not read (over METRICS_TAIL)


def _finite(v: object) -> bool:
    """A number the report can compute and plot with: finite and within ±MAX_FIGURE (an integer of 400 digits
    is not: it is no float at all)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v) and abs(v) <= MAX_FIGURE
    except OverflowError:
        return False


def read_run(path: Path) -> RunData:
    """Everything the report plots; BadInput (exit 2) when RUN is not a run directory or has no training line."""
    try:
        rd = RunDir.open(path)
    except OSError as e:
        raise BadInput(f"{path}: cannot read the run directory: {e}") from None
    name = path.name
    try:
        from hpcscale.config.yamlsrc import parse_yaml

        text = read_bounded(rd.path / JOB, max_bytes=1 << 20, what=JOB).decode("utf-8")
        doc = parse_yaml(text, JOB).data
        if isinstance(doc, dict) and isinstance(doc.get("name"), str):
            name = doc["name"]
    except Exception:  # a damaged (or odd: a FIFO) job.yaml costs the title, not the report
        pass
    data = RunData(clean(name, limit=200))
    first_step: dict[int, int] = {}
    timed: dict[tuple[int, int | None], dict] = {}  # a step's time and throughput logged before its loss
    tail = read_tail(rd.path / METRICS, max_bytes=METRICS_TAIL, what="metrics log", missing_ok=True)
    if tail is None:
        raise BadInput(f"{rd.path}: no {METRICS}: the run has not logged a step yet")
    data.cut_bytes = tail.cut
    marks: list[dict] = []  # each attempt's step times and restores, for the relaunches' downtime
    for line in tail.data.splitlines():
        if not line.strip():
            continue
        try:
            row = loads_json(line, source=str(rd.path / METRICS), max_bytes=MAX_LINE) if len(line) <= MAX_LINE else None
        except BadInput:
            row = None
        if not isinstance(row, dict) or type(row.get("step")) is not int or not -1 <= row["step"] <= MAX_STEP:
            data.skipped += 1
            continue
        step, attempt = row["step"], row.get("attempt")
        attempt = attempt if type(attempt) is int else None
        when = row.get("time") if _finite(row.get("time")) else None
        if attempt is not None and when is not None and ("restore_s" in row or "loss" in row) and len(marks) < 1 << 20:
            marks.append({k: row[k] for k in ("attempt", "time", "loss", "restore_s") if k in row})
        loss = row.get("loss")
        if _finite(loss):  # a string, a 1e308 or a nested value is not a loss to plot: the line is skipped
            data.train[step] = {k: row[k] for k in KEPT if k in row}
            for k, v in timed.pop((step, attempt), {}).items():  # hpcscale's line came first
                data.train[step].setdefault(k, v)
            if attempt is not None:
                first_step[attempt] = min(first_step.get(attempt, step), step)
        else:
            data.skipped += "loss" in row
            got = {k: row[k] for k in TIMED if k in row}
            if got and "loss" not in row:
                # hpcscale's own line for a user loop's step (ctx.checkpoint.step): its time and throughput
                # belong with the loss the loop logs for that step in the same attempt, before or after it
                if step in data.train and data.train[step].get("attempt") == row.get("attempt"):
                    data.train[step].update(got)
                elif len(timed) < 100_000:
                    timed[(step, attempt)] = got
        if _finite(row.get("val_loss")):
            data.val[step] = float(row["val_loss"])
        if isinstance(row.get("model_flops"), dict):
            data.model_flops = row["model_flops"]
        saved = row.get("checkpoint")
        if type(saved) is int and 0 <= saved <= MAX_STEP and when is not None and len(data.saves) < 100_000:
            data.saves.append((row["checkpoint"], float(when), attempt))
    if not data.train:
        raise BadInput(f"{rd.path / METRICS}: no training line (step and loss) to report")
    events = rd.attempt_events()
    data.relaunches = relaunch_downtimes(events, marks)
    data.usage = usage(events, data)
    for event in events:
        if event.get("event") != "begin" or type(event.get("attempt")) is not int:
            continue
        data.attempts += 1
        attempt = event["attempt"]
        if attempt > 1 and attempt in first_step:
            data.restarts.append((first_step[attempt], _when(event.get("time")), attempt))
    return data


def _when(stamp: object) -> float:
    try:
        return datetime.fromisoformat(str(stamp)).timestamp()
    except ValueError:
        return math.nan


def tokens_by_step(data: RunData) -> dict[int, float] | None:
    """Cumulative tokens at the end of each step (tokens_per_s × step_time_s of each step); a step logged without
    them (the first step after a resume, a step whose timing line was lost) counts as the median timed step's
    tokens, since every step of a run trains the same global batch. None when no step logs them (a Context entry
    point that logs only its loss)."""
    per_step = {}
    for step, row in data.train.items():
        if _finite(row.get("tokens_per_s")) and _finite(row.get("step_time_s")):
            per_step[step] = row["tokens_per_s"] * row["step_time_s"]
    if not per_step:
        return None
    typical = sorted(per_step.values())[len(per_step) // 2]
    out, total = {}, 0.0
    for step in sorted(data.train):
        total += per_step.get(step, typical)
        if not math.isfinite(total) or total > MAX_FIGURE:
            return None
        out[step] = total
    return out


def untimed_steps(data: RunData) -> int:
    """How many training steps logged no tokens/s and step time (tokens_by_step counts them at the median)."""
    return sum(
        1 for row in data.train.values() if not (_finite(row.get("tokens_per_s")) and _finite(row.get("step_time_s")))
    )


def usage(events: list[dict], data: RunData) -> dict:
    """Node-hours and GPU-hours of the run over all its attempts: each attempt's time from its begin record to
    its end record (or, for one that left none, killed or still running, to its last logged step) times its
    nodes, and times its ranks where they ran on GPUs (one GPU per rank). `gpu_hours` is None when no attempt
    ran on GPUs, or one did not record its device (a run of an older version)."""
    last_logged: dict[int, float] = {}
    for row in data.train.values():
        a, t = row.get("attempt"), row.get("time")
        if type(a) is int and _finite(t):
            last_logged[a] = max(last_logged.get(a, t), t)
    begins: dict[int, dict] = {}
    ends: dict[int, float] = {}
    for e in events:
        a = e.get("attempt")
        if type(a) is not int:
            continue
        if e.get("event") == "begin":
            begins[a] = e
        elif e.get("event") == "end" and math.isfinite(_when(e.get("time"))):
            ends[a] = _when(e.get("time"))
    node_h = gpu_h = 0.0
    gpus_known, on_gpus, counted = True, False, 0
    for a, b in begins.items():
        start = _when(b.get("time"))
        stop = ends.get(a, last_logged.get(a))
        nodes, world = b.get("nodes"), b.get("world_size")
        if not (math.isfinite(start) and stop is not None and isinstance(nodes, list) and type(world) is int):
            continue
        hours = max(0.0, stop - start) / 3600
        if hours > 1e6 or len(nodes) > 1e6 or world > 1e8:  # a record others may write: no figure from nonsense
            continue
        counted += 1
        node_h += hours * len(nodes)
        device = b.get("device")
        if device is None:
            gpus_known = False
        elif device == "cuda":
            on_gpus = True
            gpu_h += hours * world
    return {
        "attempts": counted,
        "node_hours": round(node_h, 4),
        "gpu_hours": round(gpu_h, 4) if on_gpus and gpus_known else None,
    }


def energy_kwh(windows) -> float | None:
    """The GPUs' energy over every attempt, kWh: per attempt, the sum over ranks of the newest window's `energy_j`
    (each rank's GPU since its attempt started, NVML); None when no window has it (CPU ranks, no NVML)."""
    newest: dict[object, dict] = {}
    for w in windows:
        if any("energy_j" in r for r in w.ranks):
            newest[w.attempt] = {i: r["energy_j"] for i, r in enumerate(w.ranks) if _finite(r.get("energy_j"))}
    if not newest:
        return None
    return round(sum(sum(per.values()) for per in newest.values()) / 3.6e6, 6)


def build(run: Path, out: Path) -> dict:
    """Write the report into `out` (created; never written through a symlink); returns what was written."""
    from hpcscale.observe.timing import judge, judge_arrivals, read_windows, traffic

    data = read_run(run)
    try:
        windows = read_windows(run / TIMING)
    except BadInput:  # a FIFO or a device: no per-rank timing, the rest of the report stands
        windows = []
    data.usage["energy_kwh"] = energy_kwh(windows)
    verdict = judge(windows) if windows else None
    comm = None
    if windows:
        comm = {
            "step": windows[-1].step,
            "steps": windows[-1].steps,
            "groups": [g.to_json() for g in traffic(windows[-1])],
            "late": judge_arrivals(windows).to_json(),
        }
    import matplotlib

    matplotlib.use("Agg")
    images = {"loss.png": _plot_loss(data), "throughput.png": _plot_throughput(data)}
    if any(_finite(r.get(k)) for r in data.train.values() for k in EFFICIENCY):
        images["efficiency.png"] = _plot_efficiency(data)
    if windows:
        images["ranks.png"] = _plot_ranks(windows, verdict)
    summary = summarize(data, verdict, list(images), comm=comm)
    files = {**images, "summary.md": render_markdown(summary).encode()}
    dfd = _open_out(out)
    try:
        for name, content in files.items():
            try:  # a symlink planted at name is replaced, never followed
                atomic_write(name, content, dir_fd=dfd)
            except OSError as e:  # a directory at the name; another user's file there in a sticky -o; a full disk
                raise BadInput(
                    f"-o {out}: cannot write {out / name} ({e.strerror}"
                    + (
                        "; something that is not a file of yours is at that name: remove it, or choose another -o)"
                        if e.errno in (errno.EISDIR, errno.EPERM, errno.EACCES, errno.ENOTEMPTY, errno.EEXIST)
                        else ")"
                    )
                ) from None
    finally:
        os.close(dfd)
    return {"run": str(run), "out": str(out), "files": [str(out / n) for n in files], "summary": summary}


def _open_out(out: Path) -> int:
    """The output directory, created if missing (mode 0755 whatever the umask), opened once with
    O_NOFOLLOW|O_DIRECTORY: a symlink at `out` (planted before, or swapped in after the mkdir) is refused;
    everything is then written relative to it. One that exists is used only if it is the user's or root's and
    no one else can write it, or sticky (hpcscale.util.trust.check_dir_fd): someone who made it first could
    otherwise replace the report's files after it is written."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.mkdir(mode=0o755)
    except FileExistsError:
        pass  # one that exists (a directory, a symlink or a file): judged below, on the descriptor
    except OSError as e:
        raise BadInput(f"-o {out}: cannot create the directory ({e.strerror})") from None
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(out):
            raise BadInput(f"-o {out}: a symbolic link; the report writes only into a real directory") from None
        if e.errno == errno.ENOTDIR:
            raise BadInput(f"-o {out}: exists and is not a directory") from None
        raise BadInput(f"-o {out}: cannot open the directory ({e.strerror})") from None
    try:
        check_dir_fd(fd, out, what="report directory (-o)", sticky_ok=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _save(fig) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _mark(ax, data: RunData, *, x_of) -> None:
    """Restarts as red dashed lines, saves as grey ticks, on an axis whose x is `x_of(step)`."""
    for i, (step, _, _) in enumerate(data.restarts):
        x = x_of(step)
        if x is not None:
            ax.axvline(x, color="tab:red", ls="--", lw=1, label="restart" if i == 0 else None)
    for i, (step, _, _) in enumerate(data.saves):
        x = x_of(step - 1)
        if x is not None:
            ax.axvline(x, color="0.75", lw=0.6, zorder=0, label="checkpoint" if i == 0 else None)


def _plot_loss(data: RunData) -> bytes:
    import matplotlib.pyplot as plt

    steps = sorted(data.train)
    loss = [data.train[s]["loss"] for s in steps]
    tokens = tokens_by_step(data)
    fig, axes = plt.subplots(2 if tokens else 1, 1, figsize=(8, 6.5 if tokens else 3.5), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, loss, lw=1, label="training loss")
    if data.val:
        vs = sorted(data.val)
        ax.plot(vs, [data.val[s] for s in vs], "o-", ms=3, label="validation loss")
    _mark(ax, data, x_of=lambda s: s)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{data.name}: loss")
    ax.legend(fontsize=8)
    if tokens:
        ax = axes[1][0]
        ax.plot([tokens[s] for s in steps], loss, lw=1, label="training loss")
        if data.val:
            vs = [s for s in sorted(data.val) if s in tokens]
            ax.plot([tokens[s] for s in vs], [data.val[s] for s in vs], "o-", ms=3, label="validation loss")
        _mark(ax, data, x_of=lambda s: tokens.get(s))
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    return _save(fig)


def _plot_efficiency(data: RunData) -> bytes:
    """MFU (or model TFLOPS per device where no peak is known) and the memory peaks, against the step."""
    import matplotlib.pyplot as plt

    steps = sorted(data.train)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)

    def series(key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        got = [(s, data.train[s][key] * scale) for s in steps if _finite(data.train[s].get(key))]
        return [s for s, _ in got], [v for _, v in got]

    xs, mfu = series("mfu", 100.0)
    if mfu:
        top.plot(xs, mfu, lw=1, color="tab:green")
        top.set_ylabel("MFU, %")
    else:
        xs, tflops = series("tflops")
        top.plot(xs, tflops, lw=1, color="tab:green")
        top.set_ylabel("model TFLOPS per device")
        if not tflops:
            top.text(0.5, 0.5, "no model FLOPs logged", ha="center", va="center", transform=top.transAxes)
    _mark(top, data, x_of=lambda s: s)
    flops = data.model_flops or {}
    peak = flops.get("peak_tflops")
    how = f" against {peak:g} TFLOPS per device" if _finite(peak) else " (no peak known: no MFU)"
    top.set_title(f"{data.name}: efficiency{how}")
    for key, label in (
        ("mem_gb", "device, allocated"),
        ("mem_reserved_gb", "device, reserved"),
        ("rss_gb", "host RSS"),
    ):
        xs, gb = series(key)
        if gb:
            bottom.plot(xs, gb, lw=1, label=label)
    bottom.set_xlabel("step")
    bottom.set_ylabel("memory peak, GB")
    if bottom.lines:
        bottom.legend(fontsize=8)
    xs, watts = series("power_w")
    if watts:  # a GPU's power (NVML), rank 0's: on the memory panel's step axis, its own scale
        power = bottom.twinx()
        power.plot(xs, watts, lw=0.8, color="tab:red", alpha=0.6)
        power.set_ylabel("GPU power, W (rank 0)", color="tab:red")
    return _save(fig)


def _plot_throughput(data: RunData) -> bytes:
    import matplotlib.pyplot as plt

    rows = [data.train[s] for s in sorted(data.train) if _finite(data.train[s].get("time"))]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    if rows and _finite(rows[0].get("tokens_per_s")):
        t0 = min(r["time"] for r in rows)
        by_attempt: dict[object, list[dict]] = {}
        for r in rows:  # one line per attempt: no line drawn across the gap of a restart
            by_attempt.setdefault(r.get("attempt"), []).append(r)
        for part in by_attempt.values():
            part.sort(key=lambda r: r["time"])
            tps = [r["tokens_per_s"] if _finite(r.get("tokens_per_s")) else math.nan for r in part]
            ax.plot([(r["time"] - t0) / 60 for r in part], tps, lw=1, color="tab:blue")
        for i, (_, when, _) in enumerate(data.restarts):
            if math.isfinite(when):
                ax.axvline((when - t0) / 60, color="tab:red", ls="--", lw=1, label="restart" if i == 0 else None)
        for i, (_, when, _) in enumerate(data.saves):
            ax.axvline((when - t0) / 60, color="0.75", lw=0.6, zorder=0, label="checkpoint" if i == 0 else None)
        if data.restarts or data.saves:
            ax.legend(fontsize=8)
        ax.set_xlabel("minutes since the first logged step (queue waits between attempts included)")
        ax.set_ylabel("tokens/s")
    else:
        ax.text(0.5, 0.5, "this run does not log tokens/s", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"{data.name}: throughput")
    return _save(fig)


def _nodes_of(windows, rank: int) -> str:
    """The node(s) `rank` ran on, in the order of the attempts (a resume may have moved it), for its label."""
    seen = list(dict.fromkeys(w.nodes[rank] for w in windows if rank < len(w.nodes)))
    shown = [clean(n, limit=24) for n in seen[-3:]]
    return ("…→" if len(seen) > 3 else "") + "→".join(shown)


def rank_grid(windows):
    """(rows x windows array of own ms/step, ranks per row) for ranks.png: one column per window of every
    attempt, NaN where an attempt had no such rank; over PLOT_ROWS ranks, contiguous ranks share a row holding
    their slowest."""
    import numpy as np

    n = max(len(w.ranks) for w in windows)
    grid = np.full((n, len(windows)), np.nan)
    for j, w in enumerate(windows):
        grid[: len(w.ranks), j] = [row["own_s"] * 1000 for row in w.ranks]
    grid = np.clip(grid, 0.0, MAX_FIGURE)
    per_row = -(-n // PLOT_ROWS)
    if per_row > 1:
        rows = -(-n // per_row)
        padded = np.full((rows * per_row, len(windows)), np.nan)
        padded[:n] = grid
        blocks = padded.reshape(rows, per_row, len(windows))
        seen = ~np.isnan(blocks).all(axis=1)
        grid = np.where(seen, np.where(np.isnan(blocks), -np.inf, blocks).max(axis=1), np.nan)
    return grid, per_row


def _plot_ranks(windows, verdict) -> bytes:
    """Own time per rank and window over every attempt (a rank an attempt did not have is grey); over PLOT_ROWS
    ranks, contiguous ranks share a row showing their slowest."""
    import matplotlib.pyplot as plt
    import numpy as np

    n = max(len(w.ranks) for w in windows)
    grid, per_row = rank_grid(windows)
    nrows = grid.shape[0]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.25 * nrows + 1.5)))
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("lightgrey")
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap)
    fig.colorbar(image, ax=ax, label="own ms/step (window mean)" + (", slowest of the row" if per_row > 1 else ""))
    slow = set(verdict.slow_ranks) if verdict is not None else set()
    slow_rows = {r // per_row for r in slow}
    ax.set_yticks(range(nrows))
    if per_row == 1:
        labels = [f"{'straggler ' if i in slow else ''}{i} ({_nodes_of(windows, i)})" for i in range(n)]
    else:
        labels = [
            f"{'straggler ' if i in slow_rows else ''}{i * per_row}-{min(n, (i + 1) * per_row) - 1}"
            for i in range(nrows)
        ]
    ax.set_yticklabels(labels, fontsize=7 if nrows > 16 else 8)
    for i, label in enumerate(ax.get_yticklabels()):
        if i in slow_rows:
            label.set_color("tab:red")
    ticks = list(range(0, len(windows), max(1, len(windows) // 10)))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(windows[i].step) for i in ticks], fontsize=8)
    for i in range(1, len(windows)):
        if windows[i].attempt != windows[i - 1].attempt:
            ax.axvline(i - 0.5, color="white", ls="--", lw=1.5)  # a restart
    ax.set_xlabel("window's last step")
    ax.set_ylabel("rank (node)" if per_row == 1 else f"ranks ({per_row} a row)")
    ax.set_title("per-rank own time over every attempt, not waiting on others (dashed: a restart)")
    return _save(fig)


def summarize(data: RunData, verdict, images: list[str], *, comm: dict | None = None) -> dict:
    """The summary's figures; `comm`: the newest window's traffic per group and the late-arrival verdict."""
    steps = sorted(data.train)
    last = data.train[steps[-1]]
    tokens = tokens_by_step(data)
    times = [r["step_time_s"] for r in data.train.values() if _finite(r.get("step_time_s"))]
    tps = [r["tokens_per_s"] for r in data.train.values() if _finite(r.get("tokens_per_s"))]

    def median(key: str) -> float | None:
        got = sorted(r[key] for r in data.train.values() if _finite(r.get(key)))
        return got[len(got) // 2] if got else None

    def peak(key: str) -> float | None:
        got = [r[key] for r in data.train.values() if _finite(r.get(key))]
        return max(got) if got else None

    flops = data.model_flops if isinstance(data.model_flops, dict) else {}
    efficiency = {
        "median_mfu": median("mfu"),
        "median_tflops": median("tflops"),
        "flops_per_token": flops.get("flops_per_token") if _finite(flops.get("flops_per_token")) else None,
        "flops_source": clean(flops.get("source"), limit=20) if flops.get("source") is not None else None,
        "peak_tflops": flops.get("peak_tflops") if _finite(flops.get("peak_tflops")) else None,
        "device": clean(flops.get("device"), limit=80) if flops.get("device") is not None else None,
        "mem_gb": peak("mem_gb"),
        "mem_reserved_gb": peak("mem_reserved_gb"),
        "rss_gb": peak("rss_gb"),
    }
    return {
        "name": data.name,
        "steps": len(steps),
        "last_step": steps[-1],
        "final_loss": float(last["loss"]),
        "best_val_loss": min(data.val.values()) if data.val else None,
        "final_val_loss": data.val[max(data.val)] if data.val else None,
        "tokens": round(tokens[steps[-1]]) if tokens else None,
        "untimed_steps": untimed_steps(data) if tokens else 0,
        "median_step_s": sorted(times)[len(times) // 2] if times else None,
        "median_tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,
        "attempts": data.attempts,
        "restarts": [{"step": s, "attempt": a} for s, _, a in data.restarts],
        "relaunches": [{"attempt": a, **d} for a, d in sorted(data.relaunches.items())],
        "checkpoints": sorted({s for s, _, _ in data.saves}),
        "stragglers": None if verdict is None else verdict.to_json(),
        "communication": comm,
        "efficiency": efficiency,
        "usage": data.usage,
        "skipped_lines": data.skipped,
        "metrics_bytes_not_read": data.cut_bytes,
        "images": images,
    }


def render_markdown(s: dict) -> str:
    def num(v, fmt):
        return "—" if v is None else format(v, fmt)

    restarts = ", ".join(f"attempt {r['attempt']} from step {r['step']}" for r in s["restarts"])
    saved = s["checkpoints"]
    shown = ", ".join(map(str, saved[-8:])) + (" …" if len(saved) > 8 else "")
    n = s.get("untimed_steps", 0)
    untimed = f"; {n} step(s) without timing counted as the median step" if n else ""
    lines = [
        f"# {s['name']}",
        "",
        "| | |",
        "|---|---|",
        f"| steps logged | {s['steps']} (last step {s['last_step']}) |",
        f"| final training loss | {s['final_loss']:.4f} |",
        f"| validation loss, final / best | {num(s['final_val_loss'], '.4f')} / {num(s['best_val_loss'], '.4f')} |",
        f"| tokens | {num(s['tokens'], ',')} (tokens/s × step time, summed over steps{untimed}) |",
        f"| median step | {num(s['median_step_s'] and s['median_step_s'] * 1000, '.1f')} ms |",
        f"| median tokens/s | {num(s['median_tokens_per_s'], ',.0f')} |",
        f"| attempts | {s['attempts']} ({len(s['restarts'])} restart(s){': ' + restarts if restarts else ''}) |",
        f"| checkpoints saved | {len(saved)}{f' (steps {shown})' if saved else ''} |",
    ]
    for r in s.get("relaunches", []):  # a failed step relaunched in its allocation (restart.spare_nodes)
        parts = ", ".join(
            f"{word} {num(r[key], '.1f')} s"
            for word, key in (("detection", "detect_s"), ("step start", "start_s"), ("load", "load_s"),
                              ("first step", "first_step_s"))
        )  # fmt: skip
        lines.append(
            f"| relaunched in place after attempt {r['attempt']} | training stopped {num(r['total_s'], '.1f')} s "
            f"({parts}) |"
        )
    v = s["stragglers"]
    if v is None:
        lines.append("| stragglers | no per-rank timing recorded (metrics.timing_every) |")
    elif v["reason"]:
        lines.append(f"| stragglers | no verdict: {v['reason']} |")
    elif v["slow_ranks"]:
        slow = [r for r in v["ranks"] if r["rank"] in v["slow_ranks"]]
        named = ", ".join(
            f"rank {r['rank']} on {clean(r['node'], limit=40)} ({r['relative']:.2f}× its peers)" for r in slow
        )
        lines.append(f"| stragglers | {named} |")
    else:
        lines.append(f"| stragglers | none in the last {v['windows']} windows of the newest attempt |")
    lines += _efficiency_rows(s.get("efficiency"))
    u = s.get("usage") or {}
    if u.get("attempts"):
        gpu = num(u["gpu_hours"], ".4g") if u["gpu_hours"] is not None else "— (no attempt recorded GPU ranks)"
        lines.append(f"| node-hours, GPU-hours | {u['node_hours']:.4g}, {gpu} (over {u['attempts']} attempt(s)) |")
    if "energy_kwh" in u:
        energy = (
            num(u["energy_kwh"], ".4g") + " kWh" if u["energy_kwh"] is not None else "not measured (no NVML reading)"
        )
        lines.append(f"| GPU energy | {energy} |")
    lines += _communication_rows(s.get("communication"))
    if s["skipped_lines"]:
        lines.append(f"| damaged metrics lines skipped | {s['skipped_lines']} |")
    if s.get("metrics_bytes_not_read"):
        lines.append(
            f"| metrics.jsonl read | its last {METRICS_TAIL >> 20} MiB only ({s['metrics_bytes_not_read']:,} bytes "
            "before them not read) |"
        )
    lines.append("")
    for image in s["images"]:
        lines += [f"![{image}]({image})", ""]
    return "\n".join(lines)


def _efficiency_rows(e: dict | None) -> list[str]:
    """Summary rows: MFU and TFLOPS per device (medians over the logged steps), the model FLOPs per token and
    how they were found, and the memory peaks (docs/observability.md#efficiency)."""
    if not e:
        return []
    out = []
    if e["median_tflops"] is not None:
        mfu = f"MFU {100 * e['median_mfu']:.1f} %, " if e["median_mfu"] is not None else ""
        peak = (
            f" against {e['peak_tflops']:g} TFLOPS per {e['device']}"
            if e["peak_tflops"] is not None
            else f" (no peak known for {e['device']}: no MFU)"
        )
        out.append(f"| efficiency (median) | {mfu}{e['median_tflops']:.4g} model TFLOPS per device{peak} |")
    if e["flops_per_token"] is not None:
        out.append(f"| model FLOPs per token | {e['flops_per_token']:.4g} ({e['flops_source']}) |")
    memory = [
        f"{word} {e[key]:.2f} GB"
        for word, key in (
            ("device allocated", "mem_gb"),
            ("device reserved", "mem_reserved_gb"),
            ("host RSS", "rss_gb"),
        )
        if e[key] is not None
    ]
    if memory:
        out.append(f"| memory peak (rank 0) | {', '.join(memory)} |")
    return out


def _communication_rows(comm: dict | None) -> list[str]:
    """Summary rows: each group's bytes per step in the newest window (by kind, with GB/s over the time blocked
    in them where a rank was blocked), and the ranks the others waited for at collectives."""
    if not comm or not comm["groups"]:
        return []
    first = comm["step"] - comm["steps"] + 1
    rows = []
    for g in comm["groups"]:
        kinds = ", ".join(
            f"{clean(kind, limit=40)} {human_bytes(k['bytes'])} × {k['n']:g}"
            for kind, k in sorted(g["kinds"].items())
            if k["n"] > 0
        )
        rate = "" if g["gbps"] is None else f"; {g['gbps']:.2f} GB/s over {g['wait_s'] * 1000:.1f} ms blocked"
        rows.append(
            f"| traffic per step, {clean(g['group'], limit=64)} (steps {first}-{comm['step']}) | "
            f"{human_bytes(g['bytes'])} on {g['ranks']} rank(s): {kinds}{rate} |"
        )
    late = comm["late"]
    if late["reason"]:
        rows.append(f"| late arrivals | no verdict: {late['reason']} |")
    elif late["slow_ranks"]:
        by_rank = {r["rank"]: r for r in late["ranks"]}
        named = ", ".join(
            f"rank {r} on {clean(by_rank[r]['node'], limit=40)} ({by_rank[r]['late_s'] * 1000:.1f} ms per step at "
            f"{clean(', '.join(by_rank[r]['groups']), limit=200)})"
            for r in late["slow_ranks"]
        )
        rows.append(f"| late arrivals (the others waited for) | {named} |")
    else:
        rows.append(f"| late arrivals | none in the last {late['windows']} windows of the newest attempt |")
    return rows

"""`ctx.metrics`: the run's metrics file, RUN/metrics.jsonl (JSON lines written by global rank 0 only; TensorBoard
events beside it with `metrics.tensorboard`), and the progress echo on stdout. Every line names its attempt
(RUN/attempts.jsonl). The file is appended to as every log of hpcscale is (hpcscale.portable.files), its
descriptor held."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hpcscale.errors import BadInput

METRICS_LINE_BYTES = 1 << 20  # the longest metrics line: a line is one write, and readers bound what they take


def _appender(path: Path):
    """RUN/metrics.jsonl opened for appending as every log of hpcscale is (portable.files.JsonLinesAppender: never
    through a symlink planted at its name, only a regular file, one write per line, a line over
    METRICS_LINE_BYTES refused whole), the descriptor held: a line per step costs one write. BadInput naming the
    file otherwise."""
    from hpcscale.portable import files

    try:
        return files.JsonLinesAppender(path, max_line=METRICS_LINE_BYTES)
    except files.NotRegularFile:
        raise BadInput(f"{path}: not a regular file; refusing to append the run's metrics to it") from None


def _append(appender, rows: list[dict]) -> None:
    from hpcscale.portable import files

    try:
        appender.append(rows)
    except files.NotRegularFile:
        raise BadInput(f"{appender.path}: not a regular file; refusing to append the run's metrics to it") from None
    except files.TooLarge as e:
        raise BadInput(
            f"ctx.metrics.log: a line of {e.size} bytes, over the {METRICS_LINE_BYTES} bytes a metrics line may "
            "have: log fewer or smaller values per call"
        ) from None


def _loggable(value: Any, depth: int = 0) -> bool:
    """Whether `value` is a metrics value: plain JSON or one-element tensors (read when written), bounded
    nesting."""
    if value is None or isinstance(value, bool | int | float | str) or _scalar_tensor(value):
        return True
    if depth < 8 and isinstance(value, list | tuple):
        return all(_loggable(v, depth + 1) for v in value)
    if depth < 8 and isinstance(value, dict):
        # json writes int, float, bool and None keys as strings; anything else it refuses
        return all(
            (k is None or isinstance(k, str | int | float)) and _loggable(v, depth + 1) for k, v in value.items()
        )
    return False


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "numel")  # torch stays unimported


def _scalar_tensor(value: Any) -> bool:
    return _is_tensor(value) and value.numel() == 1


def _plain(value: Any) -> Any:
    """`value` (a _loggable one) with its tensors read: what json.dumps writes."""
    if _scalar_tensor(value):
        return value.item()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# what hpcscale itself writes into a metrics line: the progress line says these its own way
OWN_KEYS = frozenset(
    {"step", "time", "attempt", "step_time_s", "tokens_per_s", "comm_share", "restored_from", "restore_s"}
    | {"tflops", "mfu", "mem_gb", "mem_reserved_gb", "pinned_gb", "rss_gb", "model_flops"}
    | {"energy_j", "power_w", "gpu_util", "sm_clock_mhz", "throttle"}
)
OWN_PREFIXES = ("checkpoint", "local_checkpoint", "xsite_")  # saves and cross-site rounds: their own lines say them
# what only hpcscale writes (log_health): `hpcscale status` reads warning signs and the checkpoints they
# caused from these keys, so a line of the user's loop cannot pose as one
HEALTH_KEYS = frozenset({"health", "health_checkpoint"})


class MetricsLogger:
    """JSON lines in RUN/metrics.jsonl, written by global rank 0 only; `print` echoes progress to stdout.
    Every line names its attempt (RUN/attempts.jsonl): a step repeated after a requeue or resume is told apart."""

    def __init__(self, path: Path | None, *, attempt: int | None = None, tensorboard: Path | None = None):
        self.path = path
        self.attempt = attempt
        # rank 0's metrics file, appended to line by line (_append); None on other ranks. Opened now: a planted
        # FIFO or symlink is refused before the training starts
        self._f = _appender(path) if path is not None else None
        self._tb = None
        # the newest numbers the loop logged (rank 0): the progress line shows them beside the pace
        self._latest: dict[str, float] = {}
        if tensorboard is not None and path is not None:  # metrics.tensorboard: the same lines as events
            from hpcscale.observe.tensorboard import TensorBoardSink

            self._tb = TensorBoardSink(tensorboard)

    def log(self, **values: Any) -> None:
        """Append one JSON line of `values` to metrics.jsonl (rank 0; every rank checks them): numbers,
        strings, booleans, None and one-element tensors (a loss, a norm), and lists and dicts of them; a
        tensor's value is read where the line is written: on rank 0 (a host sync there), on no other rank.
        Anything else, and the keys hpcscale's warning signs are written under (`health`, `health_checkpoint`;
        log_health writes them), is BadInput naming the key."""
        taken = sorted(HEALTH_KEYS & values.keys())
        if taken:
            raise BadInput(
                f"ctx.metrics.log: {taken[0]} is the key hpcscale's own warning signs are written under "
                "(`hpcscale status` reads it); log the value under another name"
            )
        for key, value in values.items():
            if not _loggable(value):
                what = f"a tensor of {value.numel()} elements" if _is_tensor(value) else f"a {type(value).__name__}"
                raise BadInput(
                    f"ctx.metrics.log: {key} is {what}; log numbers, strings, booleans, None (lists and dicts of "
                    "them) or a one-element tensor"
                )
        self._write(values)

    def _write(self, values: dict[str, Any]) -> None:
        if self._f is not None:
            values = {k: _plain(v) for k, v in values.items()}
            head = (
                {"time": round(time.time(), 3)}
                if self.attempt is None
                else {"time": round(time.time(), 3), "attempt": self.attempt}
            )
            row = {**head, **values}
            _append(self._f, [row])
            for k, v in values.items():
                own = k in OWN_KEYS or k.startswith(OWN_PREFIXES)
                if not own and isinstance(v, int | float) and not isinstance(v, bool):
                    self._latest.pop(k, None)  # the newest key last: the line shows the ones logged most recently
                    self._latest[k] = v
            if self._tb is not None:
                self._tb.log(row)

    def latest(self, n: int = 4) -> list[tuple[str, float]]:
        """The newest `n` numbers the loop logged, (key, value) oldest first, hpcscale's own keys left out: what
        the progress line shows beside the pace. Rank 0's; empty on every other rank."""
        return list(self._latest.items())[-n:] if n > 0 else []

    def print(self, message: str) -> None:
        if self._f is not None:
            print(message, flush=True)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def log_health(metrics: MetricsLogger, step: int, **entry: Any) -> None:
    """hpcscale's own line of warning signs (`health=[signs]`) or of the checkpoint they caused
    (`health_checkpoint={...}`) at `step`: the one writer of those keys (the step loop's), which
    `MetricsLogger.log` refuses."""
    if not entry or set(entry) - HEALTH_KEYS:
        raise ValueError(f"log_health takes {', '.join(sorted(HEALTH_KEYS))}, not {sorted(entry)}")
    metrics._write({"step": step, **entry})

"""What a run directory's files (written by whoever could write them) make hpcscale do, continued: bounded work
from attempts.jsonl, node-local.json and the job's logs; Slurm's answers read through the parser; state
directories made, not adopted (docs/runbook.md, "Shared run directories: what hpcscale trusts").

Work is bounded by counting what the code does (dict look-ups, Python calls) at two input sizes, never by timing
on a loaded machine.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.observe.interval import job_mtbf


# ---- job_mtbf: one pass over attempts.jsonl ------------------------------------------------------------------
class _Counted(dict):
    """An attempts.jsonl record that counts how often it is read."""

    reads = 0

    def get(self, key, default=None):
        _Counted.reads += 1
        return super().get(key, default)

    def __getitem__(self, key):
        _Counted.reads += 1
        return super().__getitem__(key)


def _attempts(n: int) -> list[dict]:
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    out = []
    for a in range(n):
        at = t0 + timedelta(hours=a)
        out.append(_Counted(event="begin", attempt=a, time=at.isoformat()))
        out.append(_Counted(event="end", attempt=a, cause="failed", time=(at + timedelta(minutes=30)).isoformat()))
    return out


def _reads(n: int) -> int:
    events = _attempts(n)
    _Counted.reads = 0
    m = job_mtbf(node_mtbf_hours=100, nodes=1, events=events, now=0)
    assert m.failures == n and m.exposure_s == n * 1800
    return _Counted.reads


def test_job_mtbf_reads_each_attempt_record_a_bounded_number_of_times():
    """At every job start the ranks estimate the MTBF from attempts.jsonl, which others may append to: the
    records read grow with the log, not with its square (each begin looked through every event)."""
    small, large = _reads(200), _reads(1600)
    assert large <= 8 * small * 1.1, (small, large)  # 8x the records: about 8x the reads (it was 64x)


def _reference_mtbf(*, events, now):
    """The estimate as documented (job_mtbf's docstring), attempt by attempt: what the one-pass version must give."""
    begins = [e for e in events if e.get("event") == "begin" and isinstance(e.get("time"), str)]

    def seconds(stamp):
        try:
            return datetime.fromisoformat(stamp).timestamp()
        except (ValueError, TypeError):
            return None

    failures, exposure = 0, 0.0
    for i, begin in enumerate(begins):
        start = seconds(begin["time"])
        if start is None:
            continue
        later = begins[i + 1] if i + 1 < len(begins) else None
        own = [e for e in events if e.get("attempt") == begin.get("attempt") and e is not begin]
        end = next((e for e in own if e.get("event") == "end"), None)
        stopped = any(e.get("event") == "stop" for e in own)
        if (end is not None and end.get("cause") == "failed") or (end is None and later is not None and not stopped):
            failures += 1
        finish = seconds(end["time"]) if end is not None and isinstance(end.get("time"), str) else None
        if finish is None:
            finish = seconds(later["time"]) if later is not None else now
        if finish is not None and finish > start:
            exposure += finish - start
    return failures, exposure


_stamps = st.integers(0, 10**6).map(lambda s: datetime.fromtimestamp(1.7e9 + s, tz=timezone.utc).isoformat())
_attempt = st.one_of(st.integers(0, 3), st.sampled_from([1.0, True, None, "1", [1], [1.0], {"a": 1}, {"a": True}, []]))
_event = st.fixed_dictionaries(
    {"event": st.sampled_from(["begin", "end", "stop", "other"])},
    optional={
        "attempt": _attempt,
        "time": st.one_of(_stamps, st.sampled_from(["not a time", "", 3])),
        "cause": st.sampled_from(["failed", "completed", "preempted"]),
    },
)


@settings(max_examples=300, deadline=None)
@given(events=st.lists(_event, max_size=12), now=st.floats(1.7e9, 1.7e9 + 2e6))
def test_job_mtbf_counts_what_the_attempt_by_attempt_reading_counts(events, now):
    got = job_mtbf(node_mtbf_hours=10, nodes=2, events=events, now=now)
    failures, exposure = _reference_mtbf(events=events, now=now)
    assert got.failures == failures and abs(got.exposure_s - exposure) <= 1e-6 * max(1.0, exposure)


# ---- a hang line's world size ------------------------------------------------------------------------------------
_HANG_PROBE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))  # 2 GiB: a set of 10^8 ranks does not fit
from hpcscale.launch.failure import describe_failure, hang_line, rank_failure
from hpcscale.layout import ParallelDims
def line(world):
    return hang_line(rank=0, mpi_rank=0, node="n1", seconds=60.0, last_step=3, world_size=world)
print(describe_failure([line(10**8) + "\\n"]))
print(rank_failure([line(10**6)], dims=ParallelDims(pp=1, dp=4, tp=1))[0])
"""


def test_a_hang_line_claiming_a_huge_world_is_not_enumerated():
    """The job's logs are files others may write: a hang line saying `world 100000000` made the diagnosis build
    a set of 10^8 ranks (MemoryError under a 2 GiB limit; a world of 10^12 never ended). Such a line is no
    job's hang. With the world known from the begin record (rank_failure's dims), the silent ranks are those
    of the job's world, whatever a line says."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _HANG_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    plain, known = done.stdout.splitlines()
    assert "stopped making progress" not in plain and "Hang: no step finished" in plain, plain
    assert known == "ranks 1, 2, 3 stopped making progress (no step in 60 s; rank 0 waited on them)", known


def test_a_hang_summary_names_at_most_a_few_dozen_ranks():
    from hpcscale.launch.failure import RANKS_SHOWN, describe_failure, hang_line

    line = hang_line(rank=7, mpi_rank=7, node="n1", seconds=60.0, last_step=3, world_size=4096)
    said = describe_failure([line + "\n"])
    assert said.startswith("ranks 0, 1, 2,") and "(4095 ranks in all)" in said and len(said) < 40 * RANKS_SHOWN, said

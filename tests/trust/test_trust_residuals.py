"""What a run directory's files (written by whoever could write them) make hpcscale do, continued: bounded work
from attempts.jsonl, node-local.json and the job's logs; Slurm's answers read through the parser; state
directories made, not adopted (docs/runbook.md, "Shared run directories: what hpcscale trusts").

Work is bounded by counting what the code does (dict look-ups, Python calls) at two input sizes, never by timing
on a loaded machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.ckpt import nodelocal
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


# ---- node-local.json: the holders `resume` picks -----------------------------------------------------------------
def _write_record(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    path.chmod(0o644)
    return path


def _one_holder_each(k: int) -> dict:
    """k data files, each held by a node of its own: the cover needs every node, one at a time."""
    nodes = [f"n{i:06d}" for i in range(k)]
    return {
        "step": 8,
        "nodes": nodes,
        "holders": {f"step-00000008/data/rank-{i:05d}.bin": [n] for i, n in enumerate(nodes)},
    }


def _calls(fn) -> int:
    """Python and builtin calls (generator resumptions included) while fn() runs: the work done, on any machine."""
    n = 0

    def count(frame, event, arg):
        nonlocal n
        n += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_the_holders_of_a_large_record_are_chosen_in_work_linear_in_it(tmp_path):
    """RUN/node-local.json may be up to 4 MiB (~10^5 files and nodes): the nodes to ask for were chosen by a
    greedy cover that rescanned every remaining file for every node at every pick (cubic here: `resume` hung).
    4x the files and nodes now cost about 4x the work; a record near the 4 MiB limit is planned."""
    small = _write_record(tmp_path / "small.json", _one_holder_each(60))
    large = _write_record(tmp_path / "large.json", _one_holder_each(240))
    plan = lambda p: nodelocal.plan_from_record(p, lost=set(), max_nodes=10**6)  # noqa: E731
    assert len(plan(large).nodes) == 240
    a, b = _calls(lambda: plan(small)), _calls(lambda: plan(large))
    assert b <= 6 * a, (a, b)
    big = _one_holder_each(65_000)
    path = _write_record(tmp_path / nodelocal.RECORD, big)
    assert path.stat().st_size < nodelocal.RECORD_MAX_BYTES
    choice = nodelocal.plan_from_record(path, lost={"n000003"}, max_nodes=10**6)
    assert choice.step is None and "1 data file(s) held only by lost nodes (n000003)" in choice.why
    big["holders"]["step-00000008/data/rank-00003.bin"].append("n000004")
    choice = nodelocal.plan_from_record(_write_record(path, big), lost={"n000003"}, max_nodes=10**6)
    assert choice.step == 8 and len(choice.nodes) == 64_999 and "n000003" not in choice.nodes


def _greedy_reference(data: dict, lost: set[str]) -> list[str] | None:
    """The documented choice, node by node: the survivor holding the most files not yet held (the first listed on
    a tie) until every file is held; None when a file has no surviving holder."""
    survivors = [n for n in data["nodes"] if n not in lost]
    holders = data["holders"]
    if not survivors or any(not set(h) & set(survivors) for h in holders.values()):
        return None
    need, chosen = set(holders), []
    while need:
        best = max(survivors, key=lambda n: (sum(n in holders[f] for f in need), -survivors.index(n)))
        chosen.append(best)
        need = {f for f in need if best not in holders[f]}
    return sorted(chosen or survivors[:1])


_node = st.sampled_from([f"n{i}" for i in range(7)])


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(_node, min_size=1, max_size=8),
    holders=st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.lists(_node, max_size=4), max_size=10),
    lost=st.sets(_node, max_size=3),
)
def test_the_holders_chosen_are_the_greedy_covers(tmp_path_factory, nodes, holders, lost):
    data = {"step": 3, "nodes": nodes, "holders": holders}
    path = _write_record(tmp_path_factory.mktemp("rec") / nodelocal.RECORD, data)
    choice = nodelocal.plan_from_record(path, lost=lost, max_nodes=100)
    want = _greedy_reference(data, lost)
    assert (choice.nodes if choice.step is not None else None) == want, choice


# ---- Slurm's answers read through the parser ---------------------------------------------------------------------
def _held_job(env: dict, out: Path, err: Path) -> str:
    import subprocess

    done = subprocess.run(
        ["sbatch", "--parsable", "--hold", "-J", "x StdOut=/tmp/elsewhere", f"--output={out}", f"--error={err}",
         "--wrap", "true"],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def test_launch_reads_its_jobs_log_paths_whole_whatever_they_hold(local_cluster, tmp_path, monkeypatch, capsys):
    """An admin's own script calling `hpcscale launch`: launch warns when the job's logs are not where the
    diagnosis reads them. The paths came from `scontrol -o` through a regex that cut a value at ` X=`: a run
    directory named `run X=1` was warned about though its logs were in place. Read as hpcscale.slurm.parse
    reads `scontrol show job`, each path is whole (and a job name holding `StdOut=` changes nothing)."""
    import subprocess

    from hpcscale.launch.attempts import check_own_logs
    from hpcscale.slurm.allocation import job_log_paths

    monkeypatch.setenv("SLURM_CONF", local_cluster["SLURM_CONF"])
    run = tmp_path / "run X=1 Y"
    (run / "logs").mkdir(parents=True)
    jobs = []
    try:
        jobs.append(_held_job(local_cluster, run / "logs" / "slurm-%j.out", run / "logs" / "slurm-%j.err"))
        check_own_logs(run, jobs[-1], job_log_paths)
        assert "warning" not in capsys.readouterr().err
        jobs.append(_held_job(local_cluster, tmp_path / "elsewhere X=2.out", run / "logs" / "slurm-%j.err"))
        check_own_logs(run, jobs[-1], job_log_paths)
        said = capsys.readouterr().err
        assert f"writes its log to {tmp_path / 'elsewhere X=2.out'}, not {run.resolve()}/logs/" in said, said
        # resume and smoke read the job's accounting rows through the same parser (sacct's unlikely delimiter)
        from hpcscale.recovery.resume import _sacct_rows
        from hpcscale.slurm.client import SlurmClient
        from hpcscale.smoke.runners import _state

        subprocess.run(["scancel", jobs[0]], env={**os.environ, **local_cluster}, capture_output=True, timeout=60)
        for _ in range(60):  # accounting may trail the controller by a moment
            if rows := _sacct_rows(SlurmClient(), jobs[0]):
                break
            time.sleep(0.5)
        assert [r["JobID"] for r in rows][:1] == [jobs[0]] and set(rows[0]) >= {"State", "NodeList", "Reason"}
        assert _state(SlurmClient(), jobs[1])[0] == "PENDING"
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], env={**os.environ, **local_cluster}, capture_output=True, timeout=60)


# ---- the shared tier after a restart from the node-local tier ----------------------------------------------------
TIERS = REPO / "tests" / "helpers" / "tier_restore_ranks.py"


def _tier_ranks(tmp: Path, name: str, *, action: str, **extra) -> tuple[list[dict], str]:
    """Two ranks on emulated nodes a and b (each the other's partner): (each rank's report, their output)."""
    import subprocess

    spec = {"world": 2, "store": str(tmp / f"store-{name}"), "base": str(tmp / "nodes"), "out": str(tmp / name),
            "nodes": ["a", "b"], "action": action, **extra}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(TIERS), json.dumps(spec), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    logs = "\n".join(p.communicate(timeout=300)[0] for p in procs)
    assert all(p.returncode == 0 for p in procs), logs[-4000:]
    return [json.loads(Path(f"{tmp / name}.rank-{r}").read_text()) for r in range(2)], logs


def _invert(files) -> None:
    """Every byte of each file complemented: each chunk in it fails its hash, its size unchanged."""
    for f in files:
        f.write_bytes(bytes(b ^ 0xFF for b in f.read_bytes()))


def _verifies(step_dir: Path) -> bool:
    return run_cli("ckpt", "verify", str(step_dir)).returncode == 0


@pytest.mark.slow  # starts two gloo ranks (_tier_ranks), as the `mpi` fixture's tests do
@pytest.mark.parametrize("then", [[6], [4, 6]], ids=["next-step", "same-step-first"])
def test_after_a_node_local_restart_the_shared_tier_writes_what_it_has_not_verified(tmp_path, then):
    """Shared tier: steps 2 and 4 (step 4 keeps the unchanging tensor in step 2's data file), both damaged;
    node-local tier: 2 and 4, whole. The restart loads node-local step 4 and reads nothing from the shared tier.
    Its shared manager deduplicated against the listed step 4 it had never verified: step 6 referenced the
    damaged chunks, and a drain of step 4 itself was skipped as done. Now nothing unverified is referenced, step
    4 is moved to refused/ and drained anew, and every step drained verifies."""
    _tier_ranks(tmp_path, "build", action="build", steps=[2, 4], drain=[2, 4])
    shared = tmp_path / "nodes" / "shared"
    _invert(shared.glob("step-*/data/*.bin"))
    out, logs = _tier_ranks(tmp_path, "restore", action="restore", then=then)
    assert (out[0]["step"], out[0]["tier"], out[0]["ok"]) == (4, "node-local", True), out
    assert "refusing checkpoint" not in logs  # the shared tier was not read at the restart
    if 4 in then:
        assert _verifies(shared / "step-00000004"), "the damaged step 4 was taken as drained"
        assert [p.name[:13] for p in (shared / "refused").iterdir()] == ["step-00000004"]
        assert "moved checkpoint not verified since the restart step-00000004" in logs, logs[-3000:]
        assert sum(o["drains"]["4"]["referenced"] for o in out) == 0
    assert _verifies(shared / "step-00000006"), "step 6 references the damaged step's chunks"
    frozen = (1 << 18) * 2  # the unchanging bf16 tensor: referenced only from a step drained since the restart
    assert sum(o["drains"]["6"]["referenced"] for o in out) == (frozen if 4 in then else 0)


@pytest.mark.slow  # starts two gloo ranks (_tier_ranks), as the `mpi` fixture's tests do
def test_a_node_local_step_refused_at_the_restart_is_hashed_and_said_once(tmp_path):
    """Shared tier: 2 and 6 (6 damaged); node-local tier: 2, 4, 6 (6 damaged on both nodes). The restart tries
    node-local 6 (refused), the shared tier (6 refused, 2 loads), then node-local steps newer than 2: it tried 6
    again, hashing every copy and saying so twice. Now only 4 is tried there, and loads."""
    _tier_ranks(tmp_path, "build", action="build", steps=[2, 4, 6], drain=[2, 6])
    nodes = tmp_path / "nodes"
    _invert([*nodes.glob("[ab]/step-00000006/data/*.bin"), *nodes.glob("shared/step-00000006/data/*.bin")])
    out, logs = _tier_ranks(tmp_path, "restore", action="restore")
    assert (out[0]["step"], out[0]["tier"], out[0]["ok"]) == (4, "node-local", True), out
    assert "newer than step 2, the shared tier's newest that every rank can load" in out[0]["why"]
    assert logs.count("node-local step-00000006: the copies that verify do not make it whole") == 1, logs[-4000:]
    refused = [line for line in logs.splitlines() if "node-local copy refused" in line and "step-00000006" in line]
    assert len(refused) == 4, refused  # each node holds both data files: its own and its partner's copy


# ---- directories made, not adopted -------------------------------------------------------------------------------
_FAKE_FAILURE = "srun: error: n9: task 3: Killed\n"  # what a planted log would blame: node n9


def test_a_run_keeps_its_logs_directory_only_if_no_one_else_could_write_it(tmp_path, other_user):
    """`resume` (and the requeue decision) read a failed job's rank, node and signal from RUN/logs, which a reused
    run took as it found it: someone else's logs directory, made first, fed the diagnosis their failure lines.
    Now RUN/logs and RUN/submissions are made 0755 by a mkdir that fails on an existing name, or kept only if
    the user's or root's and no one else can write them, and RUN/logs is read through a descriptor so checked."""
    from hpcscale.recovery.joblog import attempt_lines
    from hpcscale.rundir import RunDir
    from hpcscale.util.trust import UntrustedFile

    run = tmp_path / "run"
    rd = RunDir.create(run)
    assert {(run / d).stat().st_mode & 0o7777 for d in ("logs", "submissions")} == {0o755}
    (run / "submissions.jsonl").write_text("")
    (run / "logs" / "slurm-7.err").write_text(_FAKE_FAILURE)
    assert attempt_lines(RunDir.create(run, reuse=True), "7") == [_FAKE_FAILURE.strip()]  # its own: read
    (run / "logs" / "slurm-7.err").unlink()
    (run / "logs").rmdir()
    other_user.make(run / "logs", directory=True)
    (run / "logs" / "slurm-7.err").write_text(_FAKE_FAILURE)
    with pytest.raises(UntrustedFile, match=r"logs: refusing the run's logs directory: owned by hpcscale-other"):
        RunDir.create(run, reuse=True)
    with pytest.raises(UntrustedFile, match="run's logs directory"):
        attempt_lines(rd, "7")
    (run / "logs" / "slurm-7.err").unlink()
    (run / "logs").rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "slurm-7.err").write_text(_FAKE_FAILURE)
    (run / "logs").symlink_to(elsewhere)
    with pytest.raises(UntrustedFile, match="symbolic link"):
        attempt_lines(rd, "7")
    with pytest.raises(UntrustedFile, match="symbolic link"):
        RunDir.create(run, reuse=True)


def test_a_sweep_points_run_directory_is_made_not_adopted(tmp_path, other_user):
    """An array task's RUN/sweep/NNNN holds its attempts, metrics and checkpoints: it was made with
    mkdir(exist_ok=True), so one someone else made first was used. Now it is made 0755 or accepted only if it
    and RUN/sweep are the user's (or root's) and no one else can write them."""
    from hpcscale.rundir import sweep_dir
    from hpcscale.util.trust import UntrustedFile

    mine = tmp_path / "mine"
    mine.mkdir()
    made = sweep_dir(mine, 3)
    assert made == mine / "sweep" / "0003" and made.stat().st_mode & 0o7777 == 0o755
    assert sweep_dir(mine, 3) == made  # a requeued task: its own, accepted
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    other_user.make(theirs / "sweep", directory=True)
    with pytest.raises(UntrustedFile, match="sweep: refusing the sweep point's run directory: owned by"):
        sweep_dir(theirs, 3)
    assert not (theirs / "sweep" / "0003").exists()  # nothing made inside theirs


def test_smoke_writes_and_loads_its_job_specs_only_in_directories_of_its_own(tmp_path, other_user):
    """`hpcscale smoke` writes each job's spec to ROOT/specs and loads the job from it: a specs directory (or a
    ROOT) someone else made first could swap the spec for theirs (its entry point is what the ranks run), and
    a symlink planted at a spec's name was written through."""
    from hpcscale.smoke.checks import make_plan, run_smoke
    from hpcscale.smoke.runners import _spec_file
    from hpcscale.util.trust import UntrustedFile

    root = tmp_path / "smoke"
    root.mkdir()
    victim = tmp_path / "victim.yaml"
    victim.write_text("precious\n")
    other_user.make(root / "specs", directory=True)
    (root / "specs" / "devices.yaml").symlink_to(victim)
    with pytest.raises(UntrustedFile, match="specs: refusing the smoke test's job specs directory"):
        _spec_file(root, "devices", {"name": "devices"})
    assert victim.read_text() == "precious\n"
    (root / "specs" / "devices.yaml").unlink()
    (root / "specs").rmdir()
    (root / "specs").mkdir()
    (root / "specs" / "devices.yaml").symlink_to(victim)  # the user's own directory: the link is replaced
    assert _spec_file(root, "devices", {"name": "devices"}).read_text() == "name: devices\n"
    assert victim.read_text() == "precious\n" and not (root / "specs" / "devices.yaml").is_symlink()

    theirs = other_user.make(tmp_path / "theirs", directory=True)
    plan = make_plan(site=None, local=True, ranks=2, nodes=None, partition=None, tp=1, pp=1, steps=4)

    def no_job(*args):
        raise AssertionError(f"a smoke job ran in someone else's directory: {args[:1]}")

    with pytest.raises(UntrustedFile, match="theirs: refusing the smoke test's directory: owned by"):
        run_smoke(plan, theirs, no_job, say=lambda _line: None)


def test_a_stage_never_follows_a_symlink_someone_else_planted_at_its_destination(tmp_path, other_user):
    """DST is the user's named target, used as it is (a team may share it), but a symbolic link there was
    followed whoever made it: a colleague's link at DST sent the stage into a directory of the user's own. One
    the user (or root) made is still followed."""
    import os

    from test_stage import build, make_tree, stage

    src = make_tree(tmp_path / "src", small=4)
    build(src)
    victim = tmp_path / "mine"
    victim.mkdir()
    dst = tmp_path / "dst"
    dst.symlink_to(victim)
    os.lchown(dst, other_user.uid, other_user.gid)
    done = stage(src / "manifest.json", str(src), str(dst))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{dst} is a symlink (-> {victim}) owned by uid {other_user.uid}" in done.stderr, done.stderr
    assert list(victim.iterdir()) == []
    os.lchown(dst, os.geteuid(), os.getegid())  # the user's own link: followed, as before
    done = stage(src / "manifest.json", str(src), str(dst))
    assert done.returncode == 0, done.stderr
    assert (victim / "manifest.json").is_file()

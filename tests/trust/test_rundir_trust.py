"""A run directory others can write (hpcscale.util.trust, hpcscale.rundir): hpcscale never runs their code,
writes outside through their symlinks, hangs, grows without bound, or prints a traceback or their escapes.

Real files, FIFOs, symlinks and other uids (os.chown: the tests run as root in CI). Nothing here needs Slurm:
every refusal is decided before a Slurm command would run; a `sacct`/`scontrol` probe first on PATH only
records whether one was started.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import job_spec

from hpcscale.cli.main import cli
from hpcscale.config.load import load_job
from hpcscale.errors import BadInput
from hpcscale.recovery.resume import Plan, check_submitted, plan_resume, what_it_runs
from hpcscale.rundir import RunDir, Submission, append_json_line
from hpcscale.util.bounded import read_tail
from hpcscale.util.trust import UntrustedFile, clean

OTHER_UID = 12345  # no such user: a co-user of the shared filesystem
# chown to another uid needs root; CI runs as root, and there a non-root run fails rather than skipping
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 and os.environ.get("CI") != "true", reason="chown to another uid needs root"
)


def invoke(*args) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _local_run(tmp: Path, **spec_extra) -> RunDir:
    """A run directory as `run --local` leaves it (job.yaml, site.yaml, their record, one local submission)."""
    job = job_spec(tmp / "src.yaml", tp=1, pp=1, ranks=1)
    if spec_extra:
        spec = yaml.safe_load(job.read_text())
        spec.update(spec_extra)
        job.write_text(yaml.safe_dump(spec))
    loaded = load_job(job)
    rd = RunDir.create(tmp / "run")
    rd.write_resolved(loaded.spec, loaded.site.config)
    rd.record(Submission(index=1, job_id=None, cluster=None, time=_now(), script="logs/local-1.out",
                         template="local", reason="run --local"))  # fmt: skip
    return rd


def _slurm_site(tmp: Path, conf: Path, source: list[str] | None = None) -> Path:
    site = yaml.safe_load((REPO / "site_configs" / "localcluster.yaml").read_text())
    site["slurm"]["conf"] = str(conf)
    if source:
        site["environment"]["source"] = source
    site["topology"] = {"source": "none"}
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


def _slurm_run(tmp: Path, conf: Path, source: list[str] | None = None) -> RunDir:
    """A run directory submitted to a Slurm site whose slurm.conf is `conf`, with one recorded job id."""
    job = job_spec(tmp / "src.yaml", tp=1, pp=1, ranks=1, site=str(_slurm_site(tmp, conf, source)))
    loaded = load_job(job)
    rd = RunDir.create(tmp / "run")
    rd.write_resolved(loaded.spec, loaded.site.config)
    rd.record(Submission(index=1, job_id="4242", cluster=None, time=_now(), script="submissions/0001.sbatch",
                         template="default"))  # fmt: skip
    return rd


def _probe(tmp: Path) -> tuple[dict[str, str], Path]:
    """PATH with `sacct`, `scontrol` and `sinfo` that only record that they ran: (env, marker)."""
    bin_dir, marker = tmp / "probe-bin", tmp / "slurm-ran"
    bin_dir.mkdir()
    for name in ("sacct", "scontrol", "sinfo"):
        exe = bin_dir / name
        exe.write_text(f"#!/bin/sh\necho {name} >> {marker}\n")
        exe.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, marker


def _cli(*args, env: dict | None = None, timeout: float = 60, limit_as: int | None = None):
    """`python -m hpcscale ARGS` in a fresh process, with a wall-clock timeout and optionally an address-space
    limit (bytes): a hang or unbounded memory fails the test instead of the machine."""

    def limits():
        if limit_as:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "hpcscale", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO,
        preexec_fn=limits,
    )  # fmt: skip
    r.seconds = time.monotonic() - start
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


# ---- (a) configuration only from trusted files -----------------------------------------------------------------
def test_job_yaml_of_another_uid_or_writable_by_others_or_a_symlink_is_refused(tmp_path):
    rd = _local_run(tmp_path)
    job = rd.path / "job.yaml"
    rd.load_job()  # ours, 0644: trusted
    os.chown(job, OTHER_UID, -1)
    with pytest.raises(UntrustedFile) as e:
        rd.load_job()
    assert str(job) in str(e.value) and f"uid {OTHER_UID}" in str(e.value) and "mode 0644" in str(e.value)
    r = invoke("resume", rd.path, "--dry-run")
    assert r.exit_code == 2 and f"uid {OTHER_UID}" in r.output and "refusing" in r.output
    os.chown(job, 0, -1)
    job.chmod(0o664)  # root's own file, but its group can write it
    with pytest.raises(UntrustedFile, match=r"writable by its group \(mode 0664\).*chmod go-w"):
        rd.load_job()
    job.chmod(0o644)
    (rd.path / "site.yaml").chmod(0o646)
    with pytest.raises(UntrustedFile, match=r"site\.yaml.*writable by others"):
        rd.site_config()
    (rd.path / "site.yaml").chmod(0o644)
    mine = tmp_path / "elsewhere.yaml"
    shutil.copy(job, mine)
    job.unlink()
    job.symlink_to(mine)
    with pytest.raises(UntrustedFile, match="symbolic link"):
        rd.load_job()


def _status_fixture(tmp_path, conf_mode=0o644, dir_mode=0o755, owner=0):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    conf = conf_dir / "slurm.conf"
    conf.write_text("ClusterName=x\nPluginDir=/nonexistent/planted\n")
    rd = _slurm_run(tmp_path, conf)
    conf.chmod(conf_mode)
    conf_dir.chmod(dir_mode)
    os.chown(conf, owner, -1)
    return rd, conf


@pytest.mark.parametrize(
    ("conf_mode", "dir_mode", "owner", "says"),
    [
        (0o644, 0o755, OTHER_UID, f"owned by uid {OTHER_UID}"),
        (0o664, 0o755, 0, "writable by its group"),
        (0o644, 0o777, 0, "directory of the slurm.conf"),
    ],
)
def test_status_and_resume_never_hand_slurm_an_untrusted_slurm_conf(tmp_path, conf_mode, dir_mode, owner, says):
    rd, _ = _status_fixture(tmp_path, conf_mode, dir_mode, owner)
    env, marker = _probe(tmp_path)
    for args in (("status", rd.path), ("resume", rd.path, "--dry-run")):
        r = _cli(*args, env=env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert says in r.stderr and "slurm.conf" in r.stderr
        assert not marker.exists(), "a Slurm command ran with the planted slurm.conf"


def test_status_runs_slurm_with_a_trusted_slurm_conf(tmp_path):
    rd, _ = _status_fixture(tmp_path, 0o644, 0o1777, 0)  # a sticky directory: nobody renames our file away
    env, marker = _probe(tmp_path)
    r = _cli("status", rd.path, "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert "sacct" in marker.read_text()


# ---- (b) resume runs what was submitted ---------------------------------------------------------------------------
def test_job_yaml_changed_after_submission_is_refused_with_its_diff_and_accepted_on_request(tmp_path):
    rd = _local_run(tmp_path)
    job = rd.path / "job.yaml"
    spec = yaml.safe_load(job.read_text())
    spec["environment"] = {"PYTHONPATH": "/tmp/planted\x1b]0;pwned\x07"}
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = invoke("resume", rd.path, "--dry-run")
    assert r.exit_code == 2, r.output
    assert "+environment:" in r.output and "PYTHONPATH" in r.output and "--accept-changes" in r.output
    assert "\x1b" not in r.output and "\x07" not in r.output  # the diff is shown cleaned
    record = (rd.path / ".submitted.json").read_bytes()
    r = invoke("resume", rd.path, "--dry-run", "--accept-changes")
    assert r.exit_code == 0, r.output
    assert "PYTHONPATH=" in r.output and "command: mpirun" in r.output and "dry run: nothing submitted" in r.output
    assert (rd.path / ".submitted.json").read_bytes() == record  # a dry run records nothing
    assert check_submitted(rd, accept=True)  # what the real resume does: record the files as they are now
    assert check_submitted(rd, accept=False) == []
    assert stat.S_IMODE((rd.path / ".submitted.json").stat().st_mode) == 0o600


def test_a_missing_or_foreign_record_is_refused(tmp_path):
    rd = _local_run(tmp_path)
    record = rd.path / ".submitted.json"
    os.chown(record, OTHER_UID, -1)
    with pytest.raises(UntrustedFile, match="record of what was submitted"):
        check_submitted(rd, accept=False)
    record.unlink()
    with pytest.raises(BadInput, match="no record of what was submitted"):
        check_submitted(rd, accept=False)


def test_dry_run_shows_the_environment_command_site_and_script(tmp_path):
    rd = _local_run(tmp_path, environment={"MY_SETTING": "on"})
    r = invoke("resume", rd.path, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    runs = json.loads(r.output)["runs"]
    assert runs["environment"]["MY_SETTING"] == "on" and runs["command"][0] == "mpirun"
    assert runs["site"] == "local" and runs["site_file"] == str(rd.path / "site.yaml")
    assert runs["site_config"]["scheduler"] == "local"
    # a Slurm run: the exact script, SLURM_CONF and the environment (decided before Slurm is asked anything)
    conf_dir = tmp_path / "s"
    conf_dir.mkdir()
    (conf_dir / "slurm.conf").write_text("ClusterName=x\n")
    srd = _slurm_run(conf_dir, conf_dir / "slurm.conf")
    loaded = srd.load_job()
    plan = Plan(str(srd.path), "slurm", None, None, [], ["n3"], 1)
    runs = what_it_runs(srd, plan, loaded)
    assert runs["slurm_conf"] == str(conf_dir / "slurm.conf")
    assert "#SBATCH --exclude=n3" in runs["script"] and "OMPI_MCA_btl" in runs["script"]
    assert runs["environment"]["OMPI_MCA_btl"] == "self,tcp" and runs["command"][:2] == ["hpcscale", "launch"]


def test_resume_builds_the_submission_once_and_sends_what_it_showed(tmp_path, monkeypatch):
    """One Slurm client for the whole resume (diagnosis, the shown script, sbatch), and the script sbatch gets
    is the one the plan showed, rendered once. Slurm's commands are faked: only their words matter here."""
    from hpcscale.recovery import resume as resume_lib
    from hpcscale.slurm import submit
    from hpcscale.slurm.client import SlurmClient
    from hpcscale.util import proc

    conf_dir = tmp_path / "s"
    conf_dir.mkdir()
    (conf_dir / "slurm.conf").write_text("ClusterName=x\n")
    rd = _slurm_run(conf_dir, conf_dir / "slurm.conf")
    clients, sent, renders = [], [], []
    for_site = SlurmClient.for_site.__func__

    def counted(cls, site):
        clients.append(for_site(cls, site))
        return clients[-1]

    def fake_run(self, *args, timeout=30, check=True, input=None):
        assert any(self is c for c in clients), "a Slurm command through a client resume did not build"
        out = {"sacct": "4242|FAILED|1:0|n1|x|y|None\n", "sbatch": "4343\n"}.get(args[0], "")
        if args[0] == "sbatch":
            sent.append(input)
        return proc.Completed(tuple(args), 0, out, "")

    real_render = submit.render_chosen
    monkeypatch.setattr(SlurmClient, "for_site", classmethod(counted))
    monkeypatch.setattr(SlurmClient, "run", fake_run)
    monkeypatch.setattr(submit, "render_chosen", lambda *a: renders.append(a) or real_render(*a))
    shown = []
    done = resume_lib.resume(rd, on_plan=shown.append)
    assert len(clients) == 1 and len(renders) == 1, (clients, renders)
    assert shown == [done.plan] and done.plan.submitted == "4343" and done.local is None
    assert sent == [done.plan.runs["script"]]
    assert [s.job_id for s in rd.submissions()] == ["4242", "4343"]


# ---- writes never follow planted symlinks ----------------------------------------------------------------------
def test_writes_and_appends_never_follow_planted_symlinks(tmp_path):
    rd = _local_run(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    loaded = rd.load_job()
    for name in (".job.yaml.tmp", ".site.yaml.tmp", "site.yaml"):  # the old fixed temporary name; a file itself
        p = rd.path / name
        p.unlink(missing_ok=True)
        p.symlink_to(victim)
    rd.write_resolved(loaded.spec, loaded.site.config)
    assert victim.read_text() == "precious\n"
    assert not (rd.path / "site.yaml").is_symlink()  # replaced, not written through
    for name in ("resume.jsonl", "submissions.jsonl", "attempts.jsonl"):
        p = rd.path / name
        p.unlink(missing_ok=True)
        p.symlink_to(victim)
        with pytest.raises(BadInput, match="symbolic link"):
            append_json_line(p, {"x": 1})
    with pytest.raises(BadInput, match="symbolic link"):
        rd.add_attempt_event({"event": "begin"})
    assert victim.read_text() == "precious\n"
    fifo = rd.path / "resume.jsonl"
    fifo.unlink()
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="not a regular file"):
        append_json_line(fifo, {"x": 1})
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(rd.path / "submissions")
    (rd.path / "submissions").symlink_to(outside)
    with pytest.raises(BadInput, match="refusing to write"):
        rd.write_script(2, "#!/bin/sh\n")
    assert list(outside.iterdir()) == []


def test_report_writes_into_the_directory_it_opened_even_when_swapped(tmp_path, monkeypatch):
    import hpcscale.observe.report as report

    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text("name: r\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / (s + 1)}) + "\n" for s in range(5)))
    out, aside, elsewhere = tmp_path / "out", tmp_path / "aside", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    real = report.summarize

    def swap_then_summarize(*args, **kwargs):  # the co-user's move while the report is being made
        if out.is_dir() and not out.is_symlink():
            out.rename(aside)
            out.symlink_to(elsewhere)
        return real(*args, **kwargs)

    monkeypatch.setattr(report, "summarize", swap_then_summarize)
    with pytest.raises(BadInput, match="symbolic link"):  # swapped before it was opened: refused
        report.build(run, out)
    out.unlink()
    aside.rename(out)

    def swap_after_open(name, data, _write=report.atomic_write, **kwargs):
        if out.is_dir() and not out.is_symlink():
            out.rename(aside)
            out.symlink_to(elsewhere)
        _write(name, data, **kwargs)

    monkeypatch.setattr(report, "summarize", real)
    monkeypatch.setattr(report, "atomic_write", swap_after_open)
    report.build(run, out)
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in aside.iterdir()) == ["loss.png", "summary.md", "throughput.png"]


# ---- hangs, memory, time, tracebacks, escapes ---------------------------------------------------------------
def test_fifos_and_dev_zero_in_the_run_never_hang_or_exhaust_memory(tmp_path):
    rd = _local_run(tmp_path)
    (rd.path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    os.mkfifo(rd.path / "timing.jsonl")
    (rd.path / "logs" / "local-1.out").symlink_to("/dev/zero")
    limit = 3 << 30
    r = _cli("status", rd.path, "--json", limit_as=limit)
    assert r.returncode == 0 and "timing.jsonl skipped" in r.stdout, r.stderr
    r = _cli("report", rd.path, "--json", limit_as=limit)
    assert r.returncode == 0, r.stderr
    r = _cli("resume", rd.path, "--dry-run", limit_as=limit)  # its log is /dev/zero: skipped, never read
    assert r.returncode == 0, r.stderr
    (rd.path / "metrics.jsonl").unlink()
    (rd.path / "metrics.jsonl").symlink_to("/dev/zero")
    os.mkfifo(rd.path / "attempts.jsonl")
    for args in (("status", rd.path), ("report", rd.path), ("resume", rd.path, "--dry-run")):
        r = _cli(*args, limit_as=limit)
        assert r.returncode in (0, 2), r.stderr
    assert _cli("report", rd.path, limit_as=limit).returncode == 2  # its metrics are refused: exit 2, said why


def _timing_line(n: int, step: int, slow: int | None = None) -> str:
    ranks = [[0.1, 0.2 if i == slow else 0.05, 0.05, 0, 0, 0, 0] for i in range(n)]
    return json.dumps({"time": 1.0 + step, "attempt": 1, "step": step, "steps": 5,
                       "columns": ["step_s", "own_s", "compute_s", "data_s", "dp_wait_s", "sync_s", "ckpt_s"],
                       "ranks": ranks, "nodes": [f"n{i // 8}" for i in range(n)], "pp": list(range(n))})  # fmt: skip


def test_a_big_timing_file_is_bounded_in_time_and_memory(tmp_path):
    rd = _local_run(tmp_path)
    (rd.path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    with open(rd.path / "timing.jsonl", "w") as f:
        f.write(_timing_line(150_000, 0) + "\n")  # over MAX_RANKS: skipped
        for step in range(1, 4):  # 16,384 ranks, each its own pipeline stage: judged in linear time
            f.write(_timing_line(16_384, step * 5, slow=7) + "\n")
    assert (rd.path / "timing.jsonl").stat().st_size > 3 << 20
    r = _cli("status", rd.path, "--json", limit_as=3 << 30, timeout=120)
    assert r.returncode == 0, r.stderr
    timing = json.loads(r.stdout)["timing"]
    assert len(timing["ranks"]) == 16_384 and timing["stragglers"]["slow_ranks"] == [7]
    assert r.seconds < 60
    r = _cli("report", rd.path, "--json", limit_as=3 << 30, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.seconds < 90 and "ranks.png" in r.stdout


def test_malicious_metrics_and_names_print_no_traceback_and_no_escapes(tmp_path):
    rd = _local_run(tmp_path, name="evil")
    job = rd.path / "job.yaml"
    job.write_text(job.read_text().replace("name: evil", 'name: "\\e]0;pwned\\a[link=https://x.example]click[/link]"'))
    rows = [{"step": 0, "loss": 1.0, "tokens_per_s": 1e308, "step_time_s": 1e308, "time": 1e308},
            {"step": 1, "loss": "\x1b[2Jabc", "tokens_per_s": "x"}, {"step": 2, "loss": 1e308, "val_loss": 1e308},
            {"step": 3, "loss": [1], "checkpoint_interval": {"why": "\x1b]8;;https://x\x07"}},
            {"step": 4, "loss": "[link=https://x.example]y[/link]"}]  # fmt: skip
    (rd.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "200"}
    r = _cli("status", rd.path, env=env)
    assert r.returncode == 0, r.stderr
    for text in (r.stdout, r.stderr):
        assert "\x1b]" not in text and "\x07" not in text and "\x1b[2J" not in text
    assert "[link=" in r.stdout  # shown as text, not made a link
    r = _cli("report", rd.path, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)["summary"]
    assert summary["steps"] == 1 and summary["tokens"] is None
    md = (rd.path / "report" / "summary.md").read_text()
    assert "\x1b" not in md and "\x07" not in md


# ---- the bounded readers and the sanitizer ------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30), st.integers(1, 400))
def test_read_tail_reads_at_most_its_bound_and_only_whole_lines(tmp_path_factory, lines, max_bytes):
    path = tmp_path_factory.mktemp("t") / "log"
    data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(data)
    tail = read_tail(path, max_bytes=max_bytes)
    assert len(tail.data) <= max_bytes and data.endswith(tail.data) and tail.cut + len(tail.data) == len(data)
    if tail.cut:
        assert data[tail.cut - 1 : tail.cut] == b"\n"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_clean_leaves_no_control_character(text):
    shown = clean(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in shown)


def test_plan_resume_reads_a_dev_zero_log_boundedly(tmp_path):
    rd = _local_run(tmp_path)
    (rd.path / "logs" / "local-1.out").symlink_to("/dev/zero")
    plan, _ = plan_resume(rd)
    assert plan.kind == "local" and plan.diagnosis.explanation


@settings(max_examples=120, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["files", "job.yaml", "site.yaml",
                                                                                  "text", "sha256", "version"]), c),
            max_leaves=12,
        ).map(lambda d: json.dumps(d).encode()),
    )
)  # fmt: skip
def test_any_record_of_what_was_submitted_reads_or_is_refused_cleanly(tmp_path_factory, data):
    rd = RunDir.create(tmp_path_factory.mktemp("r") / "run")
    (rd.path / ".submitted.json").write_bytes(data)
    (rd.path / ".submitted.json").chmod(0o600)
    try:
        recorded = rd.recorded()
    except BadInput:
        return
    assert set(recorded) == {"job.yaml", "site.yaml"} and all(isinstance(v, str) for v in recorded.values())


def test_timing_and_metrics_figures_beyond_any_float_are_skipped(tmp_path):
    from hpcscale.observe.timing import parse_line

    line = json.loads(_timing_line(2, 4))
    line["ranks"][0][1] = 10**400  # JSON has no limit; Python's float has
    assert parse_line(line) is None
    rd = _local_run(tmp_path)
    (rd.path / "metrics.jsonl").write_text(
        f'{{"step": 0, "loss": 1.0}}\n{{"step": 1, "loss": {10**400}}}\n{{"step": {10**400}, "loss": 1.0}}\n'
    )
    assert _cli("report", rd.path).returncode == 0
    (rd.path / "metrics.jsonl").write_text(f'{{"step": 1, "loss": {10**400}, "tokens_per_s": 1e308}}\n')
    r = _cli("status", rd.path)
    assert r.returncode == 0 and "last step 1: loss 1000" in r.stdout


def test_a_sourced_file_others_can_write_is_refused(tmp_path):
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    setup = tmp_path / "setup.sh"
    setup.write_text("export X=1\n")
    rd = _slurm_run(tmp_path, tmp_path / "slurm.conf", source=[str(setup), "/only/on/compute/nodes.sh"])
    plan = Plan(str(rd.path), "slurm", None, None, [], [], 1)
    assert what_it_runs(rd, plan, rd.load_job())["source"][0] == str(setup)
    setup.chmod(0o666)
    with pytest.raises(UntrustedFile, match=r"sources.*writable by its group and others"):
        what_it_runs(rd, plan, rd.load_job())


def test_requeue_reads_planted_metrics_as_a_bounded_tail(tmp_path):
    """The batch script's requeue decision reads RUN/metrics.jsonl: a FIFO there is not waited on, a symlink to
    /dev/zero is not read without end, and a real file's last lines are what it gets."""
    from hpcscale.recovery.requeue import _tail_rows

    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    real = tmp_path / "metrics.jsonl"
    real.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(5000)))
    t = time.monotonic()
    assert _tail_rows(fifo) == [] and _tail_rows(zero) == []
    assert time.monotonic() - t < 30
    rows = _tail_rows(real, limit=200)
    assert rows and rows[-1] == {"step": 4999} and len(rows) < 20


def test_an_error_quoting_hostile_text_reaches_the_terminal_without_control_characters(tmp_path):
    """Every command's error goes through one printer: a file name (or any quoted text) holding an escape
    sequence is shown as visible escapes, not sent to the terminal."""
    hostile = tmp_path / "job\x1b]0;owned\x07\x1b[2J.yaml"
    hostile.write_text("name: [unclosed\n")
    r = run_cli("config", "validate", str(hostile))
    assert r.returncode == 2, r.stderr
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr
    assert "\\x1b" in r.stderr


def test_rank_zero_never_writes_through_a_planted_link(tmp_path):
    """metrics.jsonl and timing.jsonl are appended to by the job's rank 0 and a local run's log is created by
    the front end: a symlink planted at any of them (pointing at a file of the victim's) is not written
    through; the victim's file is untouched."""
    from hpcscale.launch.context import MetricsLogger
    from hpcscale.launch.timing import StepTimes

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        MetricsLogger(run / "metrics.jsonl")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises((BadInput, OSError)):  # ENXIO: opened without waiting on a reader
        MetricsLogger(fifo)
    (run / "timing.jsonl").symlink_to(victim)
    StepTimes(run_dir=run, every=1, rank=0, node="n1", pp=0, attempt=1)._append({"step": 1})  # warns, goes on
    assert victim.read_text() == "precious\n"


def test_a_run_id_that_is_a_path_is_refused(tmp_path):
    rd = _local_run(tmp_path)
    assert len(rd.run_id()) == 12
    (rd.path / "run-id").unlink()
    (rd.path / "run-id").write_text("x/../../../../tmp/drop\n")
    with pytest.raises(BadInput, match="not a run id"):
        rd.run_id()


def test_checkpoint_pointers_planted_as_fifos_or_dev_zero_are_not_read(tmp_path):
    from hpcscale.ckpt.format import examine_index
    from hpcscale.ckpt.ops import latest

    root = tmp_path / "checkpoints"
    root.mkdir()
    os.mkfifo(root / "LATEST")
    assert latest(tmp_path) is None  # not waited on: no pointer, no committed step
    (root / "LATEST").unlink()
    (root / "LATEST").symlink_to("/dev/zero")
    assert latest(tmp_path) is None
    import torch

    from hpcscale.ckpt.format import DIGEST, INDEX, step_dir_name
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    (root / "LATEST").unlink()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        m = CheckpointManager(root, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, keep_last=2)
        m.save(1, {"model/w": torch.ones(4)}, {}, asynchronous=False)
    finally:
        dist.destroy_process_group()
    step = root / step_dir_name(1)
    (step / DIGEST).unlink()
    os.mkfifo(step / DIGEST)
    t = time.monotonic()
    found = examine_index(step / INDEX)
    assert time.monotonic() - t < 30
    assert any(p.file == DIGEST and "cannot be read" in p.problem for p in found.problems), found.problems


@pytest.mark.parametrize("value", ["10" * 200, "1e999", '"slow"', "-5", "NaN"])
def test_grace_advice_ignores_durations_that_are_not_measurements(tmp_path, value):
    """stop_s, step_time_s and checkpoint_blocking_s come from files others may write: a 400-digit integer,
    1e999 or a string is ignored, never an OverflowError in the batch script's requeue decision."""
    from hpcscale.recovery.requeue import grace_advice

    rd = _local_run(tmp_path)
    (rd.path / "metrics.jsonl").write_text(f'{{"step": 1, "step_time_s": {value}, "checkpoint_blocking_s": {value}}}\n')
    assert grace_advice(rd, 60) is None
    append_json_line(rd.path / "attempts.jsonl", {"event": "stop", "attempt": 1, "stop_s": 10**400})
    assert grace_advice(rd, 60) is None
    append_json_line(rd.path / "attempts.jsonl", {"event": "stop", "attempt": 2, "stop_s": 100.0})
    assert "give it at least 201 s" in grace_advice(rd, 60)


def test_clean_shows_lone_surrogates_and_separators_so_printing_never_fails():
    text = clean("a\ud800b\u2028c\u061cd\ufeffe")
    assert "\ud800" not in text and "\u2028" not in text and "\ufeff" not in text
    text.encode("utf-8")  # printable: a lone surrogate would raise UnicodeEncodeError here


def test_group_write_is_allowed_only_for_the_owners_private_group(tmp_path):
    """umask 002 with user-private groups (RHEL-like systems): group write lets no one else in."""
    import grp
    import pwd

    from hpcscale.util.trust import private_group, problem

    f = tmp_path / "job.yaml"
    f.write_text("x")
    os.chmod(f, 0o664)
    nobody = pwd.getpwnam("nobody")
    try:
        own_group = grp.getgrnam(nobody.pw_name)
    except KeyError:
        own_group = None
    os.chown(f, nobody.pw_uid, nobody.pw_gid)
    st = os.stat(f)
    assert problem(st) is not None  # not ours anyway
    os.chown(f, 0, 0)
    assert "writable by its group" in (problem(os.stat(f)) or "")  # root's group: never treated as private
    assert not private_group(os.stat(f))
    if own_group is not None and not own_group.gr_mem:
        os.chown(f, nobody.pw_uid, own_group.gr_gid)
        assert private_group(os.stat(f))


def test_resume_loads_the_job_text_it_compared(tmp_path):
    """Between resume's comparison with what was submitted and its loading of the job, a file renamed into RUN
    (one of the user's own, so it passes the owner check) must not be what runs: the compared text is."""
    rd = RunDir.open(_local_run(tmp_path).path)
    assert rd.changes_since_submitted() == []
    compared = rd.load_job().spec.name
    swapped = tmp_path / "other.yaml"
    swapped.write_text((rd.path / "job.yaml").read_text().replace(f"name: {compared}", "name: swapped-in"))
    os.replace(swapped, rd.path / "job.yaml")
    assert rd.load_job().spec.name == compared
    assert RunDir.open(rd.path).load_job().spec.name == "swapped-in"  # a fresh look sees the file as it is now

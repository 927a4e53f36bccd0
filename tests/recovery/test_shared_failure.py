"""A failure the job shares wherever it ran is not a node's: not requeued, no node excluded, said plainly.

The log's evidence (hpcscale.launch.failure.shared_failure): a rank's failure line with the bad-input mark (it
refused its input: BadInput, exit 2), the same exception on ranks of two or more nodes, or srun's first word on
a task being `Exited with exit code 2`. The Slurm tests run a job whose entry point passes a bad argument to the
Context (every rank refuses it, srun kills the slower ones: "task N: Killed") and one whose entry point raises the
same ValueError on both nodes; each ends after one attempt, cause `user_error`, and `resume --dry-run` excludes
no node and says why. One rank's exception stays `failed` (it may be its node's), named as the attempt's end
rather than the ranks srun killed after it; a rank killed with -9 (a node's failure): tests/recovery/test_resume.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from conftest import run_cli
from hypothesis import given
from hypothesis import strategies as st
from test_resume import _events, _log, _slurm_job, _spec, _submit, _wait_gone

from hpcscale.config.errors import ConfigError, ConfigIssue
from hpcscale.errors import BadInput
from hpcscale.launch.failure import FailureLine, failure_line, lost_a_peer, rank_failure, shared_failure
from hpcscale.recovery.requeue import decide
from hpcscale.recovery.resume import Diagnosis


def _line(e: BaseException, rank: int, node: str) -> str:
    return failure_line(e, rank=str(rank), mpi_rank=rank, node=node)


# ---- the log's evidence -------------------------------------------------------------------------------------
def test_a_rank_that_refused_its_input_blames_no_node_whoever_srun_killed_after_it():
    lines = [
        _line(ConfigError([ConfigIssue("job.yaml", 3, "data.manifest", "no such file")]), 2, "n2"),
        "srun: error: n2: task 2: Exited with exit code 2",
        "srun: error: n1: tasks 0-1: Killed",
        "srun: error: n2: task 3: Killed",
    ]
    said = shared_failure(lines)
    assert said is not None and "ConfigError: job.yaml:3: data.manifest" in said and "no node" in said
    summary, blamed = rank_failure(lines)
    assert blamed == [] and summary == said
    # the same line without the mark (any other exception) on one node only: a failure that may be the node's
    plain = [_line(RuntimeError("CUDA error: uncorrectable ECC error encountered"), 2, "n2"), *lines[1:]]
    plain[1] = "srun: error: n2: task 2: Exited with exit code 1"
    assert shared_failure(plain) is None
    assert rank_failure(plain)[1] == ["n2"]


def test_the_same_exception_on_two_nodes_is_the_programs_and_different_ones_are_not():
    same = [_line(ValueError("batch 12 is not divisible by 5"), r, f"n{1 + r // 2}") for r in range(4)]
    said = shared_failure(same)
    assert said is not None and "n1, n2" in said and "ValueError: batch 12" in said
    one_node = same[:2]
    assert shared_failure(one_node) is None  # two ranks of one node: that node's disk, its GPU, ...
    mixed = [*same[:3], _line(OSError("No space left on device"), 3, "n2")]
    assert shared_failure(mixed) is None
    # survivors' consequences do not count against it, nor does a hang
    lost = [*same, _line(ConnectionResetError("Connection reset by peer"), 5, "n3")]
    assert shared_failure(lost) is not None


def test_srun_saying_tasks_of_two_nodes_exited_2_first_is_bad_input_and_one_node_or_a_kill_first_is_not():
    two = ["srun: error: n1: task 0: Exited with exit code 2", "srun: error: n2: task 1: Exited with exit code 2"]
    assert shared_failure([*two, "srun: error: n3: task 2: Killed"])
    # one node's tasks only: its mount may be missing ("can't open file", exit 2): a failure that may be its own
    assert not shared_failure(["srun: error: n1: task 0: Exited with exit code 2", "srun: error: n2: task 1: Killed"])
    assert not shared_failure(["srun: error: n2: task 1: Killed", *two])
    assert not shared_failure(["srun: error: n1: task 0: Exited with exit code 1"])
    # a rank's own line, where there is one, says more than srun's exit code
    own = _line(RuntimeError("CUDA error: uncorrectable ECC error encountered"), 0, "n1")
    assert not shared_failure([own, "srun: error: n1: task 0: Exited with exit code 2"])


def test_a_nodes_fault_is_never_read_as_the_jobs_input():
    """What a broken node raises looks like input or code errors: a BadInput with an I/O error in its chain (a
    failing file system client), an import error (a driver or software mount missing there), and NCCL's words
    for a link gone, the same on both ends of it. None of them is a failure the job shares."""
    import errno

    try:
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError as e:
            raise BadInput(f"cannot read the token shard ({e.strerror})") from None
    except BadInput as e:
        io_error = e
    line = _line(io_error, 1, "n1")
    assert FailureLine.parse(line).bad_input is False and shared_failure([line]) is None
    assert rank_failure([line])[1] == ["n1"]
    # a typo stays bad input: no node's fault in its chain
    assert FailureLine.parse(_line(BadInput("train.params.lr: expected a number"), 1, "n1")).bad_input
    libcuda = ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")
    assert shared_failure([_line(libcuda, 0, "n1")]) is None  # one node: may be that node's
    assert shared_failure([_line(libcuda, 0, "n1"), _line(libcuda, 2, "n2")])  # alike on two: the environment's
    nccl = (
        "NCCL error in: ProcessGroupNCCL.cpp:2027, remote process exited or there was a network error, NCCL "
        "version 2.21.5"
    )

    class DistBackendError(RuntimeError):
        pass

    both_ends = [_line(DistBackendError(nccl), 0, "n1"), _line(DistBackendError(nccl), 2, "n2")]
    assert all(FailureLine.parse(x).peer_lost for x in both_ends) and shared_failure(both_ends) is None


def test_a_user_error_is_never_requeued_whatever_the_budget():
    d = decide(
        _spec(max_failures=5), [{"event": "begin", "attempt": 0}], job_id="7", cause="user_error", checkpoint=None
    )
    assert not d.requeue and d.cause == "user_error" and "no node is to blame" in d.why and d.backoff_s == 0
    assert Diagnosis(None, "FAILED", "", "", "sacct").shared_failure is None


words = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=60)


@given(message=words, node=st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True), rank=st.integers(0, 1 << 20),
       bad=st.booleans(), peer=st.booleans())  # fmt: skip
def test_a_failure_line_reads_back_what_it_says(message, node, rank, bad, peer):
    """Whatever the message: the mark, the node, the rank and `Type: first line` read back as written."""
    cls = (KeyError if not bad else BadInput) if not peer else ConnectionResetError
    e = cls(("Connection reset by peer: " if peer else "") + message)
    f = FailureLine.parse(_line(e, rank, node))
    assert f is not None and f.node == node and f.rank == rank and f.time is not None
    # the peer mark follows the words (a message saying "timeout" reads as a lost peer too), the bad-input mark
    # the type; a line may carry both
    assert f.bad_input == (bad and not peer) and f.peer_lost == lost_a_peer(e)
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    assert f.what == f"{cls.__name__}: {first}".strip()


# ---- on the real Slurm cluster ------------------------------------------------------------------------------
BAD_ARGUMENT = """
def train(ctx):
    import torch
    ctx.parallelize(torch.nn.Linear(4, 4), mixed_precision="fp8")  # not one it takes: BadInput on every rank
"""

SAME_EVERYWHERE = """
import torch.distributed as dist
def train(ctx):
    dist.barrier()  # every rank raises at once: ranks of both nodes write their line before srun ends the job
    raise ValueError("the dataset's vocabulary (50257) is larger than the model's (32000)")
"""

ONE_RANK = """
import os
def train(ctx):
    if os.environ["HPCSCALE_RANK"] == "1":
        raise ValueError("a value only rank 1 sees")
    import time
    time.sleep(60)  # srun kills the others after rank 1's exit: their "Killed" says nothing about them
"""


@pytest.mark.parametrize("entry", [BAD_ARGUMENT, SAME_EVERYWHERE], ids=["bad-input", "same-exception"])
def test_a_failure_every_rank_shares_ends_the_job_once_and_blames_no_node(local_cluster, tmp_path, entry):
    run = _run_entry(tmp_path, entry, local_cluster, restart={"max_failures": 3, "failure_backoff_seconds": 30})
    ends = [e for e in _events(run) if e["event"] == "end"]
    assert len(ends) == 1, ends  # not requeued: no backoff, no second attempt
    end = ends[0]
    assert end["cause"] == "user_error" and end["requeue"] is False, end
    assert "no node is to blame" in end["failure"] and "no node is to blame" in end["why"]
    log = _log(run)
    assert "ended: user_error" in log and "died of signal" not in log.split("ended: user_error")[1].splitlines()[0]
    dry = run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["exclude"] == [], plan  # no healthy node excluded for a typo
    assert plan["diagnosis"]["shared_failure"] and "user error" in plan["diagnosis"]["explanation"]
    assert any("failed alike wherever it ran" in w for w in plan["warnings"]), plan["warnings"]
    if entry is BAD_ARGUMENT:
        assert "mixed_precision is 'fp8'" in plan["diagnosis"]["shared_failure"]
    else:
        assert "n1, n2" in plan["diagnosis"]["shared_failure"]


def test_one_ranks_exception_is_how_the_attempt_ended_not_the_ranks_srun_killed_after_it(local_cluster, tmp_path):
    """One rank raises (a failure that may be its node's: requeued while the budget allows, its node blamed by
    resume); srun kills the others, which it reports as "Killed": the attempt ended with the rank's exception,
    exit 1, not "task N died of signal 9"."""
    run = _run_entry(tmp_path, ONE_RANK, local_cluster, restart={"max_failures": 0})
    (end,) = [e for e in _events(run) if e["event"] == "end"]
    assert end["cause"] == "failed" and end["exit_code"] == end["srun_exit_code"] != 137, end
    assert "rank 1 (MPI rank 1) on node n2 failed: ValueError: a value only rank 1 sees" in end["failure"], end
    assert "died of signal" not in _log(run)
    plan = json.loads(run_cli("resume", str(run), "--dry-run", "--json", env=local_cluster).stdout)
    assert plan["exclude"] == ["n2"] and not plan["diagnosis"]["shared_failure"], plan


def _run_entry(tmp_path, entry: str, env: dict, *, restart: dict):
    """A 2-node, 2-rank job of the local cluster running `entry` as its entry point, waited for: its run dir."""
    (tmp_path / "shared_failure_entry.py").write_text(entry)
    job = _slurm_job(tmp_path / "job.yaml", restart=restart)
    spec = yaml.safe_load(job.read_text())
    spec["train"]["entry"] = "shared_failure_entry:train"
    spec["environment"] = {"PYTHONPATH": str(tmp_path)}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    job_id = _submit(job, run, env)
    assert _wait_gone(job_id, env, timeout=240) == "FAILED", _log(run)[-3000:]
    return run


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))

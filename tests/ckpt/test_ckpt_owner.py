"""A run never writes into, or lets its retention delete in, another run's checkpoints, whatever the route to
them (a symlink, a copied run directory): every checkpoint directory carries its owner's run id."""

from __future__ import annotations

from pathlib import Path

from conftest import run_cli
from trainjobs import job_spec


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_refuses_checkpoints_another_run_owns_or_no_run_marked(mpi, tmp_path):
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=1, steps=4,
                   checkpoint={"every_steps": 2, "keep_last": 1})  # fmt: skip
    a = tmp_path / "a"
    first = run_cli("run", str(job), "--local", "--run-dir", str(a), timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    owner = (a / "checkpoints" / ".hpcscale-run").read_text().strip()
    assert owner == (a / "run-id").read_text().strip()
    before = _listing(a / "checkpoints")

    b = tmp_path / "b"  # a run directory whose checkpoints/ leads to a's
    b.mkdir()
    (b / "submissions.jsonl").touch()
    (b / "checkpoints").symlink_to(a / "checkpoints", target_is_directory=True)
    second = run_cli("run", str(job), "--local", "--run-dir", str(b), "--reuse", "-p", "train.params.steps=8",
                     timeout=300)  # fmt: skip
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]  # refused input, as the CLI's
    assert f"holds the checkpoints of another run (run id {owner}" in second.stdout + second.stderr
    assert _listing(a / "checkpoints") == before  # nothing written, nothing deleted

    c = tmp_path / "c"  # ... or to a directory no run has marked
    c.mkdir()
    (c / "submissions.jsonl").touch()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (c / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    third = run_cli("run", str(job), "--local", "--run-dir", str(c), "--reuse", timeout=300)
    assert third.returncode == 2 and "which no run has marked as its own" in third.stdout + third.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]

"""Every documented config key does something: a schema field that no code reads is a failing test, and the
keys whose effect is not visible elsewhere are proven here by changing them and watching the behaviour change.

"Read" is decided on the source: a field of a nested section (site `filesystems.checkpoint_root`, job
`checkpoint.keep_last`) counts only when some module outside the schema files reads `<section>.<field>` (also
through a local name bound to the section, `policy = spec.checkpoint; policy.keep_last`); fields of top-level
and list items count when their attribute is read anywhere; the trainer's params also through their string key.
The sbatch templates count as readers.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import typing
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli
from trainjobs import job_spec

from hpcscale.config import job, site, train

SCHEMA_FILES = {"config/site.py", "config/job.py", "config/train.py", "config/fields.py", "config/decode.py"}
SCHEMA_FILES |= {"config/render.py"}  # to_plain: dumps every field generically, which proves nothing


def _reads() -> tuple[set[str], set[tuple[str, str]], set[str]]:
    attrs: set[str] = set()
    chains: set[tuple[str, str]] = set()
    strings: set[str] = set()
    package = REPO / "hpcscale"
    for path in package.rglob("*.py"):
        if str(path.relative_to(package)) in SCHEMA_FILES:
            continue
        tree = ast.parse(path.read_text())
        alias = {}  # local name -> the attribute it was bound from (policy = spec.checkpoint)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
                alias.update({t.id: node.value.attr for t in node.targets if isinstance(t, ast.Name)})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                attrs.add(node.attr)
                if isinstance(node.value, ast.Attribute):
                    chains.add((node.value.attr, node.attr))
                elif isinstance(node.value, ast.Name):
                    chains.add((alias.get(node.value.id, node.value.id), node.attr))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    for template in (REPO / "sbatch_templates").glob("*.j2"):
        for section, field in re.findall(r"(\w+)\.(\w+)", template.read_text()):
            chains.add((section, field))
            attrs.add(field)
    return attrs, chains, strings


def test_every_schema_field_is_read_by_some_code():
    attrs, chains, strings = _reads()
    classes = [
        obj
        for module in (site, job, train)
        for obj in vars(module).values()
        if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__
    ]
    sections: dict[type, list[str]] = {}  # nested section class -> the attribute names it is reached through
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                sections.setdefault(hints[f.name], []).append(f.name)
    # the parallel degrees are read through the axis registry (Parallel.degrees: getattr by each axis' key)
    from hpcscale.layout import keyed_axes

    by_registry = {a.key for a in keyed_axes()} if ("parallel", "degrees") in chains else set()
    unread = []
    for cls in classes:
        for f in dataclasses.fields(cls):
            if cls is job.Parallel and f.name in by_registry:
                read = True
            elif cls in sections:
                read = any((section, f.name) in chains for section in sections[cls])
            elif cls is train.TrainConfig:
                read = f.name in attrs or f.name in strings
            else:
                read = f.name in attrs
            if not read:
                unread.append(f"{cls.__name__}.{f.name}")
    assert not unread, f"documented keys that no code reads (make them work or remove them): {unread}"


def test_checkpoint_root_puts_checkpoints_there_and_every_command_follows(mpi, tmp_path: Path):
    """filesystems.checkpoint_root: the run's checkpoints land under <root>/<run name>, RUN/checkpoints leads
    there, and `ckpt ls RUN`, `status`-style readers and a resume find them through the run directory."""
    local = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    local["filesystems"]["checkpoint_root"] = str(tmp_path / "burst")
    local["filesystems"]["scratch"] = str(tmp_path / "scratch")
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(local))
    tiny = {"tp": 1, "pp": 1, "ranks": 2, "site": str(tmp_path / "site.yaml"), "checkpoint": {"every_steps": 2}}
    spec = job_spec(tmp_path / "job.yaml", steps=4, **tiny)
    run = tmp_path / "run"
    first = run_cli("run", str(spec), "--local", "--run-dir", str(run), timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    target = tmp_path / "burst" / f"run-{(run / 'run-id').read_text().strip()}"
    assert (run / "checkpoints").is_symlink() and (run / "checkpoints").resolve() == target.resolve()
    assert sorted(p.name for p in target.glob("step-*")) == ["step-00000002", "step-00000004"]
    ls = run_cli("ckpt", "ls", str(run), "--json")
    assert ls.returncode == 0 and sorted(c["step"] for c in json.loads(ls.stdout)["checkpoints"]) == [2, 4]
    # A longer run in the same directory resumes from what lives under the checkpoint root.
    job_spec(tmp_path / "job.yaml", steps=6, **tiny)
    again = run_cli("run", str(spec), "--local", "--run-dir", str(run), "--reuse", timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed from checkpoint step 4" in again.stdout
    assert (target / "step-00000006").is_dir() and not (run / "checkpoints" / "..").samefile(run)


def test_a_checkpoint_root_never_moves_checkpoints_already_in_the_run(tmp_path: Path):
    from hpcscale.rundir import link_checkpoints

    (tmp_path / "run" / "checkpoints" / "step-00000001").mkdir(parents=True)
    link_checkpoints(tmp_path / "run", tmp_path / "burst" / "run", run_id="abc")
    assert not (tmp_path / "run" / "checkpoints").is_symlink()
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()


def test_two_runs_with_the_same_directory_name_never_share_a_checkpoint_directory(tmp_path: Path):
    """projA/runs/baseline and projB/runs/baseline under one checkpoint root: each gets its own directory,
    and a directory that belongs to another run is refused (its retention would delete the other's steps)."""
    from hpcscale.errors import BadInput
    from hpcscale.rundir import RunDir, link_checkpoints

    root = tmp_path / "burst"
    targets = []
    for project in ("projA", "projB"):
        rd = RunDir.create(tmp_path / project / "runs" / "baseline")
        run_id = rd.run_id()
        assert rd.run_id() == run_id  # stable
        targets.append(link_checkpoints(rd.path, root / f"baseline-{run_id}", run_id=run_id).resolve())
    assert targets[0] != targets[1]
    other = RunDir.create(tmp_path / "projC" / "baseline")
    with pytest.raises(BadInput, match="holds the checkpoints of another run"):
        link_checkpoints(other.path, targets[0], run_id=other.run_id())

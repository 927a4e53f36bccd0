"""sbatch rendering: golden files for every template x Slurm site, shellcheck, sbatch --test-only, quoting.

Regenerate the golden files (after checking the diff is intended) with:
    HPCSCALE_REGEN_GOLDEN=1 python -m pytest tests/slurm/test_render.py
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import REPO, need, run_cli

from hpcscale.cli.main import cli
from hpcscale.config.load import load_job
from hpcscale.errors import BadInput
from hpcscale.slurm.allocation import site_tree
from hpcscale.slurm.render import render_script
from hpcscale.slurm.resolve import resolve
from hpcscale.topology.tree import parse_scontrol_topology

GOLDEN = REPO / "tests" / "golden"
SLURM_SITES = ["localcluster", "localcluster2", "example-dgx-h100", "example-4gpu-a100"]
TEMPLATES = ["default", "container", "array"]
LOCAL_TOPOLOGY = (
    "SwitchName=leaf1 Level=0 Nodes=n[1-2]\nSwitchName=leaf2 Level=0 Nodes=n[3-4]\n"
    "SwitchName=spine Level=1 Nodes=n[1-4] Switches=leaf[1-2]\n"
)
SITE_GPUS = {"localcluster": 0, "localcluster2": 0, "example-dgx-h100": 8, "example-4gpu-a100": 4}

EXTRA = {
    "default": "train:\n  entry: builtin\n  params: {steps: 100, global_batch: 64, micro_batch: 1}\n",
    "container": "container:\n  image: nvcr.io#nvidia/pytorch:24.05-py3\n  mounts: [/data:/data:ro]\n"
    "train:\n  entry: builtin\n  params: {global_batch: 64, micro_batch: 1}\n",
    "array": "sweep:\n  params: {lr: [0.001, 0.0003], seed: [1, 2]}\n  max_parallel: 2\ncommand: [python3, train.py]\n",
}


def golden_spec(template: str, site: str, tmp_path: Path) -> Path:
    gpus = SITE_GPUS[site]
    text = (
        f"name: golden-{template}\nsite: {site}\nnodes: 2\ntasks_per_node: {gpus or 2}\n"
        f"gpus_per_node: {gpus}\ncpus_per_task: 2\ntime_limit: '00:10:00'\n"
    )
    if gpus:
        text += "account: proj-123\nenvironment:\n  NCCL_DEBUG: WARN\n"
    path = tmp_path / f"{template}-{site}.yaml"
    path.write_text(text + EXTRA[template])
    return path


def render_golden(template: str, site: str, tmp_path: Path, run_dir: Path | None = None) -> str:
    loaded = load_job(golden_spec(template, site, tmp_path))
    cfg = loaded.site.config
    if site.startswith("localcluster"):
        tree = parse_scontrol_topology(LOCAL_TOPOLOGY)  # the local clusters' tree, fixed for determinism
    elif cfg.topology.source == "file":
        tree = site_tree(cfg)
    else:
        tree = None  # an example site's controller cannot be asked from here
    job = resolve(loaded, run_dir=run_dir or Path(f"/runs/{site}/{template}"), tree=tree)
    return render_script(job, template)


CASES = [(t, s) for t in TEMPLATES for s in SLURM_SITES]


@pytest.mark.parametrize(("template", "site"), CASES, ids=[f"{t}-{s}" for t, s in CASES])
def test_golden(template, site, tmp_path):
    text = render_golden(template, site, tmp_path)
    path = GOLDEN / f"{template}__{site}.sbatch"
    if os.environ.get("HPCSCALE_REGEN_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing {path}: HPCSCALE_REGEN_GOLDEN=1 python -m pytest tests/slurm/test_render.py"
    assert text == path.read_text()  # whole-file comparison: a missing line fails too


def _shellcheck(text: str, tmp_path: Path) -> None:
    need(shutil.which("shellcheck") is not None, "shellcheck (Debian package)")
    script = tmp_path / "check.sbatch"
    script.write_text(text)
    out = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize(("template", "site"), CASES, ids=[f"{t}-{s}" for t, s in CASES])
def test_rendered_scripts_pass_shellcheck(template, site, tmp_path):
    _shellcheck(render_golden(template, site, tmp_path), tmp_path)


@pytest.mark.parametrize("template", TEMPLATES)
def test_local_slurmctld_accepts_each_template(template, local_cluster, tmp_path):
    text = render_golden(template, "localcluster", tmp_path, run_dir=tmp_path / "run")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    out = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, env={**os.environ, **local_cluster}
    )
    assert out.returncode == 0, out.stderr
    assert "to start at" in out.stderr  # sbatch: Job <id> to start at ... using N processors on nodes ...


HOSTILE = [
    "x; touch /tmp/hpcscale-pwned",
    "$(touch /tmp/hpcscale-pwned)",
    "`touch /tmp/hpcscale-pwned`",
    'it\'s "quoted"',
    "a\nnewline",
    "back\\slash $HOME ${PATH} *",
    "",
]


def test_hostile_values_stay_single_words(tmp_path):
    site = (REPO / "site_configs" / "localcluster.yaml").read_text()
    site = site.replace(
        "environment:\n  variables:\n",
        "environment:\n  modules: ['x; touch /tmp/hpcscale-pwned', '$(id)']\n"
        "  source: ['/opt/my setup/env.sh']\n  variables:\n",
    )
    (tmp_path / "site.yaml").write_text(site)
    import yaml

    spec = {
        "name": "x'; rm -rf ~ $(id) `id`",
        "site": str(tmp_path / "site.yaml"),
        "nodes": 2,
        "tasks_per_node": 2,
        "environment": {f"V{i}": v for i, v in enumerate(HOSTILE)},
        "command": ["printenv", *HOSTILE],
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_job(tmp_path / "job.yaml")
    job = resolve(loaded, run_dir=tmp_path / "run dir; $(id)", tree=None)
    text = render_script(job)
    _shellcheck(text, tmp_path)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    # Each command parses back (as a shell would) into exactly the words that went in.
    words = list(_commands(text))
    assert ["module", "load", "x; touch /tmp/hpcscale-pwned"] in words
    assert ["module", "load", "$(id)"] in words
    assert ["source", "/opt/my setup/env.sh"] in words
    for i, value in enumerate(HOSTILE):
        assert ["export", f"V{i}={value}"] in words
    srun = next(w for w in words if w and w[0] == "srun")
    assert srun[-1] == "&"  # the ranks run in the background of the batch shell (sbatch_templates/_step.j2)
    assert srun[-len(HOSTILE) - 1 : -1] == HOSTILE
    directives = dict(line.split("=", 1) for line in text.splitlines() if line.startswith("#SBATCH --") and "=" in line)
    assert shlex.split(directives["#SBATCH --job-name"]) == ["x'; rm -rf ~ $(id) `id`"]
    assert shlex.split(directives["#SBATCH --chdir"]) == [str(tmp_path / "run dir; $(id)")]
    assert not Path("/tmp/hpcscale-pwned").exists()


def _commands(text: str):
    """Shell words of each command; a quoted value holding a newline spans lines, so join until it parses."""
    buffer = ""
    for line in text.splitlines():
        if not buffer and (not line or line.startswith("#")):
            continue
        buffer = f"{buffer}\n{line}" if buffer else line
        try:
            words = shlex.split(buffer)
        except ValueError:
            continue
        buffer = ""
        yield words


def test_local_site_cannot_render_sbatch(tmp_path):
    result = run_cli("render", str(REPO / "docs" / "examples" / "gpt-local.yaml"))
    assert result.returncode == 2
    assert "has no Slurm" in result.stderr and "--local" in result.stderr


def test_template_mismatch_and_user_templates(tmp_path):
    loaded = load_job(golden_spec("default", "localcluster", tmp_path))
    job = resolve(loaded, run_dir=Path("/runs/x"), tree=None)
    with pytest.raises(BadInput, match=r"needs a `sweep:`"):
        render_script(job, "array")
    with pytest.raises(BadInput, match=r"needs a `container:`"):
        render_script(job, "container")
    mine = tmp_path / "mine.j2"
    mine.write_text("#!/bin/bash\n#SBATCH --job-name={{ job.name | sh }}\n{{ srun | shjoin }} {{ program | shjoin }}\n")
    assert render_script(job, str(mine)).splitlines()[1] == "#SBATCH --job-name=golden-default"
    mine.write_text("{{ job.nmae }}\n")
    with pytest.raises(BadInput, match="unknown variable"):
        render_script(job, str(mine))
    mine.write_text("{% if %}\n")
    with pytest.raises(BadInput, match=r"mine\.j2:1: template syntax"):
        render_script(job, str(mine))


def test_render_cli_prints_script_for_the_local_cluster(local_cluster):
    result = run_cli("render", str(REPO / "docs" / "examples" / "hello-localcluster.yaml"), "--run-dir", "/runs/h")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --switches=1@00:01:00" in result.stdout
    assert "\nsrun --kill-on-bad-exit=1 --wait=60 --mpi=pmix --cpus-per-task=1 hostname &\n" in result.stdout


def test_bad_template_name_is_bad_input():
    r = CliRunner().invoke(cli, ["render", str(REPO / "docs/examples/gpt-dgx.yaml"), "--template", "nope"])
    assert r.exit_code == 2 and "neither a built-in" in r.output


@pytest.mark.parametrize("node", ["n1\ntouch /tmp/hpcscale-pwned #", "n1\rx", "n1\x00"])
def test_an_excluded_node_name_cannot_end_its_sbatch_line(tmp_path, node):
    """Excluded nodes come from files others may write (RUN/submissions.jsonl, timing.jsonl, the logs):
    shlex.quote keeps a newline inside its quotes, and the text after it would be a command of its own."""
    import dataclasses

    loaded = load_job(golden_spec("default", "localcluster", tmp_path))
    job = resolve(loaded, run_dir=tmp_path / "run", tree=parse_scontrol_topology(LOCAL_TOPOLOGY))
    assert "--exclude" not in render_script(job)
    hostile = dataclasses.replace(job, excluded=("n2", node))
    with pytest.raises(BadInput, match="control character"):
        render_script(hostile)

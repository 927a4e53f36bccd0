"""The user's path: build the wheel, install it into a fresh virtual environment, use it from elsewhere.

Only an editable checkout used to render (sbatch_templates/ was found beside the package, never inside it).
These tests build the wheel once per module, install it with its dependencies into a new venv (not editable,
no system site-packages), and run that venv's `hpcscale` with the working directory outside the checkout, the
checkout off PYTHONPATH, and HOME empty, so only what the wheel ships can answer.

    python3 -m pytest -q -m wheel
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, need
from test_render import GOLDEN, TEMPLATES, golden_spec

# The first install fills pip's cache (torch alone is ~200 MB); later ones take well under a minute.
pytestmark = [pytest.mark.wheel, pytest.mark.timeout(900)]

SITE = "example-dgx-h100"  # a shipped Slurm site with a topology file, modules and GPUs: every #SBATCH line
PIP = ["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]  # modules compile when imported


@dataclass(frozen=True, slots=True)
class WheelVenv:
    venv: Path
    site_packages: Path
    workdir: Path  # outside the checkout: every command runs here
    env: dict[str, str]
    timings: dict[str, float]

    def hpcscale(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The venv's `hpcscale ARGS`, run from the work directory."""
        return subprocess.run(
            [str(self.venv / "bin" / "hpcscale"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.workdir,
        )


def _check(cmd: list[str], what: str, **kwargs) -> float:
    """Run a build/install step; its own output in the failure. Returns its wall time."""
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)
    if out.returncode != 0:
        pytest.fail(f"{what} failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return time.monotonic() - start


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> WheelVenv:
    need(_has_module("pip"), "pip")
    need(_has_module("ensurepip"), "venv with ensurepip (apt-get install python3-venv)")
    root = tmp_path_factory.mktemp("wheel")
    timings: dict[str, float] = {}

    dist = root / "dist"
    # pip builds through the pyproject backend (hatchling) in an isolated environment: what `pip wheel .` does.
    timings["build"] = _check(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w", str(dist), "."],
        "pip wheel",
        cwd=REPO,
    )
    (wheel,) = dist.glob("hpcscale-*.whl")

    # A fully isolated venv, not --system-site-packages: measured here (warm pip cache, 2 cores) the whole
    # install with torch, mpi4py and h5py takes 20-35 s against ~4 s, cheap enough to prove the wheel's declared
    # dependencies really install and work, and it keeps the system's editable hpcscale (its .pth puts the
    # checkout on sys.path) out of reach. torch is pinned in the same pip call so the resolver takes that
    # release's CPU wheel instead of a multi-GB CUDA build.
    venv = root / "venv"
    timings["venv"] = _check([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    python = str(venv / "bin" / "python")
    timings["install"] = _check([python, *PIP, "torch==2.13.0", str(wheel)], "pip install of the wheel", cwd=root)

    workdir = root / "work"
    home = root / "home"  # no ~/.config/hpcscale/sites: only the shipped sites answer
    workdir.mkdir()
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "HPCSCALE_SITE_PATH")}
    env |= {"HOME": str(home), "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
        check=True,
    )
    made = WheelVenv(venv, Path(out.stdout.strip()), workdir, env, timings)
    print(f"wheel venv: {', '.join(f'{k} {v:.1f}s' for k, v in timings.items())}")
    return made


def _has_module(name: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True).returncode == 0


def test_installed_package_is_the_wheel_not_the_checkout(wheel_venv):
    probe = (
        "import json, hpcscale, hpcscale.util.resources as r; "
        "print(json.dumps({'package': hpcscale.__file__, 'templates': str(r.templates_dir()), "
        "'sites': str(r.site_configs_dir())}))"
    )
    out = subprocess.run(
        [str(wheel_venv.venv / "bin" / "python"), "-c", probe],
        capture_output=True,
        text=True,
        env=wheel_venv.env,
        cwd=wheel_venv.workdir,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    found = {k: Path(v) for k, v in json.loads(out.stdout).items()}
    package = wheel_venv.site_packages / "hpcscale"
    assert found["package"] == package / "__init__.py"
    assert found["templates"] == package / "sbatch_templates"
    assert found["sites"] == package / "site_configs"
    shipped = sorted(p.name for p in found["templates"].iterdir())
    assert shipped == sorted(p.name for p in (REPO / "sbatch_templates").iterdir())


@pytest.mark.parametrize("template", TEMPLATES)
def test_render_every_builtin_template(wheel_venv, template):
    """The wheel renders the same bytes as the checkout: the golden file, compared whole."""
    spec = golden_spec(template, SITE, wheel_venv.workdir)
    out = wheel_venv.hpcscale("render", spec.name, "--run-dir", f"/runs/{SITE}/{template}")
    assert out.returncode == 0, out.stderr
    sbatch = [line for line in out.stdout.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in sbatch
    assert "#SBATCH --gpus-per-node=h100:8" in sbatch
    if template == "array":
        assert "#SBATCH --array=0-3%2" in sbatch
    if template == "container":
        assert "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'" in out.stdout
    assert f"template '{template}'" in out.stdout
    assert out.stdout == (GOLDEN / f"{template}__{SITE}.sbatch").read_text()


def test_render_the_issue_example(wheel_venv):
    """The issue's own command: `hpcscale render docs/examples/gpt-dgx.yaml`, from another directory."""
    job = shutil.copy(REPO / "docs" / "examples" / "gpt-dgx.yaml", wheel_venv.workdir / "gpt-dgx.yaml")
    out = wheel_venv.hpcscale("render", Path(job).name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash\n")
    for line in ("--job-name=gpt-1b", "--nodes=16", "--gpus-per-node=h100:8", "--switches=1@00:30:00"):
        assert f"#SBATCH {line}" in out.stdout.splitlines()


def test_submit_dry_run(wheel_venv):
    job = shutil.copy(REPO / "docs" / "examples" / "gpt-dgx.yaml", wheel_venv.workdir / "submit-dgx.yaml")
    run_dir = wheel_venv.workdir / "submitted"
    out = wheel_venv.hpcscale(
        "submit", Path(job).name, "--site", SITE, "--dry-run", "--json", "--run-dir", str(run_dir)
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["dry_run"] is True and result["job_id"] is None
    assert result["template"] == "default"
    script = Path(result["script"])
    assert script.parent.parent == run_dir and script.is_file()
    assert f"#SBATCH --chdir={run_dir}" in script.read_text().splitlines()
    assert (run_dir / "job.yaml").is_file() and (run_dir / "site.yaml").is_file()


def test_config_show_reads_the_shipped_site(wheel_venv):
    out = wheel_venv.hpcscale("config", "show", SITE, "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["name"] == SITE
    assert Path(shown["file"]) == wheel_venv.site_packages / "hpcscale" / "site_configs" / f"{SITE}.yaml"


TINY_JOB = """\
name: wheel-tiny
site: local
nodes: 1
tasks_per_node: 2
timeout_seconds: 60
train:
  entry: builtin
  params: {steps: 4, log_every: 1, eval_every: 0, global_batch: 4, micro_batch: 2, seq_len: 16,
           n_layer: 2, n_embd: 16, n_head: 2, seed: 7}
checkpoint:
  every_steps: 2
"""


def test_run_local_trains_and_checkpoints(wheel_venv):
    """A short `run --local -n 2` of the reference trainer: mpirun starts the venv's python on 2 ranks."""
    need(shutil.which("mpirun") is not None, "mpirun (apt-get install openmpi-bin)")
    job = wheel_venv.workdir / "tiny.yaml"
    job.write_text(TINY_JOB)
    run_dir = wheel_venv.workdir / "tiny-run"
    out = wheel_venv.hpcscale("run", job.name, "--local", "-n", "2", "--run-dir", str(run_dir), timeout=240)
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [0, 1, 2, 3]
    assert all(math.isfinite(v) for v in losses.values())

    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    assert latest == "step-00000004"
    verify = wheel_venv.hpcscale("ckpt", "verify", str(run_dir / "checkpoints" / latest), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = json.loads(verify.stdout)
    assert report["passed"] is True and report["ok"] == report["items"] > 0

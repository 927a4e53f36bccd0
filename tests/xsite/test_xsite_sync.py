"""Cross-site rounds end to end on this machine: two sites' reference trainers (`hpcscale run --local`) and
their `hpcscale sync` ticks, exchanging through the staging transports over a shared filesystem. Several rounds
complete, both sites adopt every round and end on the same θ; ticks are idempotent and two at once apply a
round once; a tampered contribution is rejected with its reason and never applied."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, need, run_cli
from trainjobs import PARAMS

STEPS, H = 30, 10
STEPS_SLURM = 2 * H  # two rounds across two Slurm clusters over the capped link


def _setup(
    tmp: Path,
    *,
    steps: int = STEPS,
    wait: float = 120,
    min_sites: int = 2,
    keep_rounds: int = 10,
    adopt: str = "wait",
    entry: str = "builtin",
) -> tuple[Path, dict]:
    keys = tmp / "keys"
    for site in ("a", "b"):
        r = run_cli("sync", "keygen", "--site", site, "--out", str(tmp / f"priv-{site}"))
        assert r.returncode == 0, r.stderr
        keys.mkdir(exist_ok=True)
        (keys / f"{site}.pub").write_bytes((tmp / f"priv-{site}" / f"{site}.pub").read_bytes())
    cfg = {
        "name": "two",
        "aggregator": "a",
        "round_steps": H,
        "encoding": "fp32",
        "wait_seconds": wait,
        "keep_rounds": keep_rounds,
        "adopt": adopt,
        "quorum": {"min_sites": min_sites, "timeout_seconds": 600},
        "keys": str(keys),
        "sites": [
            {
                "name": s,
                "run": str(tmp / f"run-{s}"),
                "state": str(tmp / f"state-{s}"),
                "reach": str(tmp / f"state-{s}"),
                "key": str(tmp / f"priv-{s}" / f"{s}.key"),
            }
            for s in ("a", "b")
        ],
    }
    config = tmp / "xsite.yaml"
    config.write_text(yaml.safe_dump(cfg))
    jobs = {}
    for i, s in enumerate(("a", "b")):
        spec = {
            "name": f"site-{s}",
            "site": "local",
            "tasks_per_node": 1,
            "timeout_seconds": 120,
            "checkpoint": {"every_steps": 0, "keep_last": 10},
            "xsite": {"config": str(config), "site": s},
            "train": {"entry": "builtin", "params": {**PARAMS, "steps": steps, "seed": 7 + i}},
        }
        if entry == "user":  # a Context entry point: ctx.checkpoint makes it a site
            (tmp / "xsite_user.py").write_text(USER_ENTRY)
            spec["environment"] = {"PYTHONPATH": str(tmp)}
            spec["train"] = {"entry": "xsite_user:main", "params": {"steps": steps, "seed": 7 + i}}
        jobs[s] = tmp / f"job-{s}.yaml"
        jobs[s].write_text(yaml.safe_dump(spec))
    return config, jobs


USER_ENTRY = """
import torch
from torch import nn


def main(ctx):
    p = ctx.params
    torch.manual_seed(p["seed"])
    model = ctx.parallelize(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx.checkpoint.tokens_per_step = 32
    start = ctx.checkpoint.restore(model, opt)
    g = torch.Generator().manual_seed(p["seed"] * 1000 + start)
    for step in range(start, p["steps"]):
        x = torch.randn(32, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.metrics.log(step=step, loss=loss.item())
        ctx.checkpoint.step(step)
"""


def _tick(config: Path, site: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {"HPCSCALE_XSITE_FAULT": fault} if fault else None
    return run_cli("sync", "--config", str(config), "--site", site, "--json", env=env)


TICK_EVERY = 5.0  # seconds: the cron of the tests below, between the ticks a changed file calls for


def _moved(r: subprocess.CompletedProcess) -> bool:
    """Whether a `sync --json` tick did something (or failed): the next tick is then due at once."""
    return r.returncode != 0 or bool(json.loads(r.stdout)["events"])


def _tick_files(tmp: Path) -> list[tuple[str, int, int]]:
    """What a tick could act on: the files in both runs' checkpoints and xsite folders and in both state
    directories (a tick's own log aside), each with its size and time."""
    seen = []
    for top in ("run-a/checkpoints", "run-b/checkpoints", "run-a/xsite", "run-b/xsite", "state-a", "state-b"):
        for path in sorted((tmp / top).rglob("*")):
            if path.name != "log.jsonl":
                with contextlib.suppress(FileNotFoundError):  # a tick or a trainer renamed it meanwhile
                    st = path.stat()
                    seen.append((str(path), st.st_size, st.st_mtime_ns))
    return seen


def _tick_while(running, tmp: Path, tick_both, timeout: float = 600) -> None:
    """Both sites' ticks (`tick_both()`: whether they moved anything) while `running()`: again at once after
    ticks that moved something, else when a file a tick could act on changed, and every TICK_EVERY seconds
    whatever changed, as cron would. Each tick is a process of its own (an idle one is 0.25 s of CPU): ticking
    on a short clock alone spends the cores the trainers train on."""
    deadline = time.monotonic() + timeout
    moved, files, ticked = True, None, 0.0
    while running():
        assert time.monotonic() < deadline, "the sites did not finish"
        if moved or _tick_files(tmp) != files or time.monotonic() - ticked >= TICK_EVERY:
            moved, ticked = tick_both(), time.monotonic()
            files = _tick_files(tmp)  # a tick that moved nothing changed nothing here (its log aside)
        else:
            time.sleep(0.2)


def _run_sites(tmp: Path, config: Path, jobs: dict, *, extra_ticks: int = 6, faults: bool = False) -> dict[str, int]:
    """Both trainers, and each site's ticks until they finish (_tick_while). faults: each tick is SIGKILLed at
    the next of FAULT_POINTS in turn (where it gets that far); the one after it must complete what it left."""
    from hpcscale.xsite.rounds import FAULT_POINTS

    killed = 0
    procs = {
        s: subprocess.Popen(
            [sys.executable, "-m", "hpcscale", "run", str(jobs[s]), "--local", "--run-dir", str(tmp / f"run-{s}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for s in jobs
    }

    def tick_both() -> bool:
        nonlocal killed
        moved = False
        for s in ("a", "b"):
            fault = FAULT_POINTS[killed % len(FAULT_POINTS)] if faults else None
            r = _tick(config, s, fault)
            if r.returncode == -9:
                killed += 1
                moved = True
            else:
                assert r.returncode in (0, 1), r.stderr
                moved |= _moved(r)
        return moved

    _tick_while(lambda: any(p.poll() is None for p in procs.values()), tmp, tick_both)
    if faults:
        assert killed >= len(FAULT_POINTS), f"only {killed} ticks reached a fault point"
    for _ in range(extra_ticks):  # the last round: exported, aggregated, pushed, handed over; until nothing moves
        moved = False
        for s in ("a", "b"):
            r = _tick(config, s)
            moved |= r.returncode != 0 or bool(json.loads(r.stdout)["events"])
        if not moved:
            break
    outputs = {s: p.communicate()[0] for s, p in procs.items()}
    codes = {s: p.returncode for s, p in procs.items()}
    assert codes == {"a": 0, "b": 0}, {s: out[-3000:] for s, out in outputs.items()}
    return codes


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("faults", "adopt", "entry"),
    [(False, "wait", "builtin"), (True, "wait", "builtin"), (False, "overlap", "builtin"), (False, "wait", "user")],
    ids=["clean", "kill-9-at-each-stage", "overlap", "context-entry"],
)  # fmt: skip
def test_two_sites_complete_rounds_and_end_on_the_same_weights(mpi, tmp_path, faults, adopt, entry):
    from safetensors.torch import load_file

    steps = STEPS if faults else 2 * H  # two rounds prove the chain; the faults need three to reach every stage
    final = steps // H
    keep = 10 if faults else 2  # clean: only the newest two rounds stay, everywhere (round 0 is pruned)
    config, jobs = _setup(tmp_path, steps=steps, keep_rounds=keep, adopt=adopt, entry=entry)
    codes = _run_sites(tmp_path, config, jobs, faults=faults)
    assert codes == {"a": 0, "b": 0}
    kept = list(range(max(0, final - keep + 1), final + 1))
    names = lambda d, pattern: sorted(p.name for p in (tmp_path / d).glob(pattern))  # noqa: E731
    assert names("state-a/rounds", "round-*.json") == [f"round-{r:06d}.json" for r in kept]
    for s in ("a", "b"):
        assert names(f"state-{s}/inbox", "round-*.json") == [f"round-{r:06d}.json" for r in kept]
        assert names(f"run-{s}/xsite", "global-r*") == [f"global-r{r:06d}.safetensors" for r in kept]
        assert names(f"state-{s}/outbox", "contrib-*.json") == [f"contrib-{s}-r{r - 1:06d}.json" for r in kept if r]
    for r in [r for r in kept if r > 0]:
        doc = json.loads((tmp_path / "state-a" / "rounds" / f"round-{r:06d}.json").read_text())
        assert sorted(a["site"] for a in doc["accepted"]) == ["a", "b"] and doc["rejected"] == [], doc
        assert doc["parent"] == r - 1
        # every Δ holds exactly one round of steps (overlap: the steps taken while the round was in flight
        # count toward the next Δ, never twice), against its parent
        assert [(a["steps"], a["base_round"]) for a in doc["accepted"]] == [(H, r - 1)] * 2, doc["accepted"]
        if entry == "user":  # ctx.checkpoint.tokens_per_step × H steps
            assert [a["tokens"] for a in doc["accepted"]] == [32 * H, 32 * H], doc["accepted"]
    for s in ("a", "b"):
        adopted = [m["xsite_round"] for m in _metrics(tmp_path / f"run-{s}") if "xsite_round" in m]
        # θ(0) at the start, then every boundary; ctx.checkpoint does not know which step is the last, so a
        # Context entry waits at its last boundary too and ends on θ(final)
        assert adopted == list(range(final + (entry == "user"))), (s, adopted)
        for copy in (tmp_path / f"state-{s}" / "inbox").glob("round-*.json"):  # sites get θ only, never m
            stored = json.loads(copy.read_text())["tensors"]
            assert stored and all(n.startswith("theta/") for n in stored), (copy, sorted(stored)[:3])
    a = load_file(str(tmp_path / "run-a" / "xsite" / f"global-r{final:06d}.safetensors"))
    b = load_file(str(tmp_path / "run-b" / "xsite" / f"global-r{final:06d}.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    status = run_cli("sync", "status", "--config", str(config), "--site", "a", "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert [r["round"] for r in doc["rounds"]] == kept and doc["bytes_sent"] > 0
    assert doc["bytes_received"] > 0
    for s in ("a", "b"):  # overlap: every round after θ(0) adopted on top of the steps taken since its boundary
        adoptions = [m for m in _metrics(tmp_path / f"run-{s}") if "xsite_round" in m]
        kept = [m.get("xsite_kept_steps") for m in adoptions[1:]]
        if adopt == "overlap":
            assert all(isinstance(k, int) and 0 <= k <= H for k in kept), (s, adoptions)
        else:
            assert kept == [None] * len(kept), (s, adoptions)
    if not faults:  # egress per round and destination: every round crossed to b; a's copies to itself are not egress
        to = {(e["round"], e["to"]) for e in doc["egress"] if e["bytes"] > 0}
        assert to == {(r, "b") for r in range(final + 1)}, doc["egress"]
        text = run_cli("sync", "status", "--config", str(config), "--site", "a")
        assert f"round {final:4d}  bytes sent to: " in text.stdout, text.stdout
    if entry == "builtin" and not faults and adopt == "wait":
        for s in ("a", "b"):  # cron's usual tick, nothing to do: it never loads torch (over a second of imports)
            idle = subprocess.run([sys.executable, "-X", "importtime", "-m", "hpcscale", "sync", "--config",
                                   str(config), "--site", s, "--json"], capture_output=True, text=True)  # fmt: skip
            assert idle.returncode == 0 and json.loads(idle.stdout)["events"] == [], idle.stdout + idle.stderr[-2000:]
            loaded = [line.rsplit("|", 1)[-1].strip() for line in idle.stderr.splitlines() if "|" in line]
            assert "hpcscale.xsite.rounds" in loaded and "torch" not in loaded, s
    if not faults:  # a tick killed just after publishing did not log it; its round has no quorum time
        assert all(r["quorum_wait_s"] is not None for r in doc["rounds"][1:])


def _concurrent_ticks(config: Path, site: str, n: int = 2) -> list[dict]:
    results: list[subprocess.CompletedProcess] = []
    threads = [threading.Thread(target=lambda: results.append(_tick(config, site))) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [json.loads(r.stdout) for r in results]


def _published(docs: list[dict], r: int) -> int:
    return sum(1 for d in docs for e in d["events"] if e["event"] == "published" and e["round"] == r)


def _start(tmp: Path, jobs: dict, site: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hpcscale", "run", str(jobs[site]), "--local", "--run-dir", str(tmp / f"run-{site}")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _until(what: str, ok, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _one_round_in(tmp: Path, config: Path, jobs: dict) -> None:
    """Both trainers (H steps) start; when a's start checkpoint is down, two of a's ticks at once publish
    round 0 (exactly one of them); b's and a's ticks hand θ(0) to their runs, which adopt it, train H steps and
    finish; b's tick exports b's contribution and pushes it to a. Round 1 is left for the test to apply."""
    procs = {s: _start(tmp, jobs, s) for s in ("a", "b")}
    _until("a's start checkpoint", lambda: (tmp / "run-a" / "checkpoints" / "step-00000000").is_dir())
    docs = _concurrent_ticks(config, "a")
    assert _published(docs, 0) == 1, docs
    _until("b's run directory", lambda: (tmp / "run-b" / "job.yaml").is_file())
    assert _tick(config, "b").returncode == 0
    for s, p in procs.items():
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, (s, out[-3000:])
        assert [m["xsite_round"] for m in _metrics(tmp / f"run-{s}") if "xsite_round" in m] == [0]
    out = _tick(config, "b")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp / "state-a" / "incoming" / "b" / "contrib-b-r000000.json").exists()


def test_ticks_are_idempotent_and_two_at_once_apply_a_round_once(mpi, tmp_path):
    config, jobs = _setup(tmp_path, steps=H)
    _one_round_in(tmp_path, config, jobs)
    docs = _concurrent_ticks(config, "a")  # a's contribution, then the round: one of the two ticks
    assert _published(docs, 1) == 1, docs
    doc = json.loads((tmp_path / "state-a" / "rounds" / "round-000001.json").read_text())
    assert sorted(a["site"] for a in doc["accepted"]) == ["a", "b"] and doc["parent"] == 0
    for _ in range(2):
        _tick(config, "a")
        _tick(config, "b")
    rounds = sorted(p.name for p in (tmp_path / "state-a" / "rounds").glob("round-*.json"))
    assert rounds == ["round-000000.json", "round-000001.json"]
    before = {str(p): p.stat().st_mtime_ns for p in tmp_path.glob("state-*/**/*") if p.is_file()}
    for site in ("a", "b"):
        quiet = _tick(config, site)
        assert quiet.returncode == 0 and json.loads(quiet.stdout)["events"] == [], quiet.stdout
    after = {str(p): p.stat().st_mtime_ns for p in tmp_path.glob("state-*/**/*") if p.is_file()}
    changed = [k for k in after if before.get(k) != after[k] and not k.endswith("log.jsonl")]
    assert changed == [], changed


def test_tampered_contribution_is_rejected_with_its_reason(mpi, tmp_path):
    config, jobs = _setup(tmp_path, steps=H, min_sites=1)
    _one_round_in(tmp_path, config, jobs)
    incoming = tmp_path / "state-a" / "incoming" / "b" / "contrib-b-r000000.safetensors"
    data = bytearray(incoming.read_bytes())
    data[-1] ^= 0xFF  # one bit of b's payload flipped on the way
    incoming.write_bytes(bytes(data))
    out = json.loads(_tick(config, "a").stdout)
    rejected = [e for e in out["events"] if e["event"] == "rejected"]
    assert [e["site"] for e in rejected] == ["b"] and "sha256" in rejected[0]["reason"], out
    doc = json.loads((tmp_path / "state-a" / "rounds" / "round-000001.json").read_text())
    assert [a["site"] for a in doc["accepted"]] == ["a"]  # applied without b's
    assert [x["site"] for x in doc["rejected"]] == ["b"] and "sha256" in doc["rejected"][0]["reason"]
    again = json.loads(_tick(config, "a").stdout)
    assert not [e for e in again["events"] if e["event"] == "rejected"], "a rejection is reported once"


@pytest.mark.parametrize("bad", ["aggregator: c", "round_steps: 0"])
def test_bad_config_is_exit_2_naming_the_key(tmp_path, bad):
    config, _ = _setup(tmp_path)
    text = config.read_text()
    key, value = bad.split(": ")
    spec = yaml.safe_load(text)
    spec[key] = int(value) if value.isdigit() else value
    config.write_text(yaml.safe_dump(spec))
    r = run_cli("sync", "--config", str(config), "--site", "a")
    assert r.returncode == 2 and key in r.stderr, r.stderr


def test_crontab_example_names_real_options():
    text = (REPO / "scripts" / "xsite.crontab").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines and all("hpcscale sync --config" in line and "--site" in line for line in lines)


# ---- two Slurm clusters over a capped ssh link ----------------------------------------------------------------
LINK = "20mbit"  # the tbf cap on the namespace's loopback: what a thin WAN link does to a round


@pytest.fixture
def capped_link():
    """A network namespace whose loopback is capped at LINK (tests/helpers/sshd.py)."""
    need(shutil.which("ip") is not None and shutil.which("tc") is not None, "iproute2 (ip, tc)")
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from sshd import capped_netns

    with capped_netns(f"hpcscale-xsite-{os.getpid()}", LINK) as ns:
        yield ns


@pytest.mark.timeout(1200)
def test_two_slurm_clusters_exchange_over_a_capped_ssh_link(local_cluster, local2_held, capped_link, tmp_path):
    """Site a's trainer on cluster local1, site b's on local2 (`hpcscale submit`); their ticks run inside a
    network namespace and reach each other's state directories only through an sshd in it, over a loopback
    capped at LINK. Rounds complete, both sites adopt them and end on the same θ."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    from safetensors.torch import load_file
    from sshd import LoopbackSshd, available

    need(available(), "sshd and ssh (apt-get install openssh-server openssh-client)")
    up = subprocess.run([str(REPO / "scripts" / "localcluster"), "up", "--cluster", "local2"], capture_output=True,
                        text=True, timeout=600)  # fmt: skip
    assert up.returncode == 0, up.stderr[-2000:]
    server = LoopbackSshd(tmp_path / "sshd", netns=capped_link).start()
    try:
        config, jobs = _setup(tmp_path, steps=STEPS_SLURM)
        cfg = yaml.safe_load(config.read_text())
        cfg["ssh"] = server.ssh_command()
        for site in cfg["sites"]:
            site["reach"] = server.url(site["state"])
        config.write_text(yaml.safe_dump(cfg))
        ids = {}
        for s, cluster_site in (("a", "localcluster"), ("b", "localcluster2")):
            spec = yaml.safe_load(jobs[s].read_text())
            spec["site"] = cluster_site
            jobs[s].write_text(yaml.safe_dump(spec))
            r = run_cli("submit", str(jobs[s]), "--run-dir", str(tmp_path / f"run-{s}"), "--json", env=local_cluster)
            assert r.returncode == 0, r.stderr
            ids[s] = (json.loads(r.stdout)["job_id"], cluster_site)

        def tick(site: str) -> dict:
            r = subprocess.run(["ip", "netns", "exec", capped_link, "hpcscale", "sync", "--config", str(config),
                                "--site", site, "--json"], capture_output=True, text=True, timeout=300)  # fmt: skip
            assert r.returncode in (0, 1), r.stderr
            return json.loads(r.stdout)

        def finished() -> bool:
            return all((tmp_path / f"run-{s}" / "checkpoints" / f"step-{STEPS_SLURM:08d}").is_dir() for s in ("a", "b"))

        errors: list[str] = []

        def tick_both() -> bool:
            moved = False
            for s in ("a", "b"):
                doc = tick(s)
                errors.extend(doc["errors"])
                moved |= bool(doc["events"] or doc["errors"])
            return moved

        _tick_while(lambda: not finished(), tmp_path, tick_both, timeout=900)
        for _ in range(6):
            for s in ("a", "b"):
                tick(s)
        final = STEPS_SLURM // H
        for s in ("a", "b"):
            adopted = [m["xsite_round"] for m in _metrics(tmp_path / f"run-{s}") if "xsite_round" in m]
            assert adopted == list(range(final)), (s, adopted, errors[-5:])
        a = load_file(str(tmp_path / "run-a" / "xsite" / f"global-r{final:06d}.safetensors"))
        b = load_file(str(tmp_path / "run-b" / "xsite" / f"global-r{final:06d}.safetensors"))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
        status = json.loads(run_cli("sync", "status", "--config", str(config), "--site", "b", "--json").stdout)
        assert status["bytes_sent"] > 0 and len(status["inbox"]) >= 1
    finally:
        server.stop()


def test_overlap_restarted_mid_round_reads_its_boundary_weights_back(mpi, tmp_path):
    """adopt: overlap keeps the boundary's weights in host memory. b's first run ends mid-round (step H + H/2,
    round 1 still in flight); run again, it reads them back from its round checkpoint at H, so round 1 is
    adopted on top of the steps since H and its next Δ still holds exactly H steps against round 1."""
    config, jobs = _setup(tmp_path, steps=2 * H, adopt="overlap")
    short = tmp_path / "job-b-short.yaml"
    spec = yaml.safe_load(jobs["b"].read_text())
    spec["train"]["params"]["steps"] = H + H // 2
    short.write_text(yaml.safe_dump(spec))
    a = _start(tmp_path, jobs, "a")
    b = _start(tmp_path, {"b": short}, "b")
    adopted = lambda s: [m["xsite_round"] for m in _metrics(tmp_path / f"run-{s}") if "xsite_round" in m]  # noqa: E731
    deadline = time.monotonic() + 300
    while not (tmp_path / "run-b" / "metrics.jsonl").exists() or adopted("b") != [0]:  # θ(0) only: round 1 waits
        assert time.monotonic() < deadline, "θ(0) never reached b"
        for s in ("a", "b"):
            _tick(config, s)
        time.sleep(0.3)
    out, _ = b.communicate(timeout=300)
    assert b.returncode == 0, out[-3000:]
    assert adopted("b") == [0], "round 1 must still be in flight when b's first run ends"
    # the whole job again, in the same run directory: resumes at step H + H/2
    b = subprocess.Popen(
        [sys.executable, "-m", "hpcscale", "run", str(jobs["b"]), "--local", "--run-dir", str(tmp_path / "run-b"),
         "--reuse"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def tick_both() -> bool:
        return any([_moved(_tick(config, s)) for s in ("a", "b")])  # a list: both sites tick

    _tick_while(lambda: a.poll() is None or b.poll() is None, tmp_path, tick_both)
    for _ in range(6):
        for s in ("a", "b"):
            _tick(config, s)
    outs = {"a": a.communicate()[0], "b": b.communicate()[0]}
    assert a.returncode == 0 and b.returncode == 0, {s: o[-3000:] for s, o in outs.items()}
    assert f"round in flight since step {H}: its boundary weights read back" in outs["b"], outs["b"][-3000:]
    after = [m for m in _metrics(tmp_path / "run-b") if m.get("xsite_round") == 1]
    assert after and after[0]["xsite_kept_steps"] >= H // 2, after  # the steps since the boundary were kept
    for r in (2,):  # the Δ b made after its restart: exactly H steps against round 1
        doc = json.loads((tmp_path / "state-a" / "rounds" / f"round-{r:06d}.json").read_text())
        assert sorted((x["site"], x["steps"], x["base_round"]) for x in doc["accepted"]) == [
            ("a", H, r - 1),
            ("b", H, r - 1),
        ], doc["accepted"]

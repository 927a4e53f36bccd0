"""Cross-site rounds: one `hpcscale sync` tick, run by cron on every site (docs/cross-site.md).

Files only, pushed by the side that owns them (a site never needs to list a remote directory):

    SITE.state/                       (every site, on its own filesystem)
      outbox/contrib-<site>-rNNNNNN.{json,safetensors}   this site's signed contributions
      inbox/round-NNNNNN.{json,safetensors}              rounds the aggregator pushed here
      log.jsonl                                          what each tick did (sync status reads it)
      .hpcscale-stage/lock                               the tick lock (hpcscale.portable.lock)
    AGGREGATOR.state/ also
      incoming/<site>/contrib-...                        contributions the sites pushed
      rounds/round-NNNNNN.{json,safetensors}             published rounds: θ and momentum in one file
      quorum.json                                        when each round's first valid contribution came
      rejected.json                                      contributions rejected, and why
    SITE.run/xsite/global-rNNNNNN.safetensors           θ(r), verified, for the trainer to adopt

A tick, in order; each step is idempotent, every file is written whole under a temporary name and renamed
(its JSON last), so a tick killed anywhere leaves a state the next one completes:
1. (aggregator) publish round 0 from its own run's start checkpoint, if not yet published;
2. export: each round checkpoint of this site's run (trainer state `xsite.base_round` = b, at a round
   boundary) whose contribution for b is not in the outbox becomes one: Δ = θ(b) − θ_site (this sign),
   encoded, hashed, signed; θ(b) is the verified round in the inbox;
3. push the newest contribution to the aggregator's incoming/<site>;
4. (aggregator) for the next round r: read every site's contribution for base r − 1, reject with a reason
   what fails (signature, hash, base round, shapes, finite values, norm outliers); apply the outer step once
   a quorum is in or the timeout has passed; publish round r (θ and m together, signed);
5. (aggregator) push the newest round to every site's inbox;
6. verify the newest round in the inbox and hand θ(r) to the run.
Two ticks at once on one site: the second finds the lock held and exits 0 saying so, so exactly one applies
a round. A site that is down does not stop the others: its push fails, is logged, and is retried next tick.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpcscale.config.xsite import XsiteConfig, XsiteSite
from hpcscale.errors import BadInput
from hpcscale.portable import lock as tick_lock
from hpcscale.portable.errors import StageError
from hpcscale.portable.hashing import SHA256
from hpcscale.util.paths import expand_path
from hpcscale.xsite.roundfile import contribution_stem as contrib_stem  # one owner of the record names
from hpcscale.xsite.roundfile import round_stem

OUTBOX, INBOX, INCOMING, ROUNDS = "outbox", "inbox", "incoming", "rounds"
LOG = "log.jsonl"
QUORUM = "quorum.json"
REJECTED = "rejected.json"  # (aggregator) what was rejected and why: reported once
LOCK_DIR = ".hpcscale-stage"  # the same directory name the stage lock uses: one lock per state directory
GLOBAL_DIR = "xsite"  # in the run directory
TAG = "xsite"  # trainer_state key of a round checkpoint: {"base_round": b, "steps": n, "tokens": t}
_CONTRIB = re.compile(r"^contrib-(?P<site>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})-r(?P<base>\d{6})\.json$")
_ROUND = re.compile(r"^round-(?P<round>\d{6})\.json$")


def global_path(run: Path, r: int) -> Path:
    """θ(r) handed to a run: the trainer adopts it at a round boundary."""
    return run / GLOBAL_DIR / f"global-r{r:06d}.safetensors"


def latest_global(run: Path) -> int | None:
    d = run / GLOBAL_DIR
    found = [int(m.group(1)) for p in d.glob("global-r*.safetensors") if (m := re.match(r"global-r(\d{6})\.", p.name))]
    return max(found) if found else None


def load_global(run: Path, r: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(global_path(run, r)))


@dataclass
class TickReport:
    site: str
    locked_out: str | None = None  # another tick held the lock: who
    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, event: str, **fields: Any) -> None:
        self.events.append({"time": round(time.time(), 3), "site": self.site, "event": event, **fields})


# ---- helpers ----------------------------------------------------------------------------------------------------
def _state(site: XsiteSite) -> Path:
    return expand_path(site.state)


def _run(site: XsiteSite) -> Path:
    return expand_path(site.run)


FAULT_POINTS = ("exported", "pushed", "published", "round_pushed", "handed")


def _fault(point: str) -> None:
    """Crash tests: HPCSCALE_XSITE_FAULT=<point> SIGKILLs the tick there (one environment lookup otherwise)."""
    if os.environ.get("HPCSCALE_XSITE_FAULT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _atomic_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _round_checkpoints(run: Path) -> list[tuple[int, dict]]:
    """(step, xsite tag) of every committed checkpoint of the run that is a round checkpoint, oldest first."""
    from hpcscale.ckpt.format import INDEX, committed_steps, read_index, step_dir_name

    root = run / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for step in sorted(committed_steps(root)):
        try:
            state = read_index(root / step_dir_name(step) / INDEX).trainer_state
        except Exception:  # a damaged checkpoint is not a round to export; verify says why
            continue
        tag = state.get(TAG)
        if isinstance(tag, dict) and type(tag.get("base_round")) is int:
            out.append((step, tag))
    return out


def _consolidated(run: Path, step: int) -> dict[str, torch.Tensor]:
    from hpcscale.ckpt.export import consolidated
    from hpcscale.ckpt.format import step_dir_name

    return {k: v.float() for k, v in consolidated(run / "checkpoints" / step_dir_name(step)).items()}


def _push(cfg: XsiteConfig, files: list[Path], src_dir: Path, dst: str) -> int:
    """Stage `files` (in src_dir) to the endpoint `dst` with the staging transports; bytes sent."""
    from hpcscale.data.manifest import Manifest, entry_for
    from hpcscale.xsite.stage import StageOptions, stage_files

    entries = [entry_for(src_dir, f.name, SHA256) for f in files]
    opts = StageOptions(jobs=1, ssh=tuple(str(expand_path(a)) if a.startswith("~") else a for a in cfg.ssh))
    result = stage_files(Manifest(SHA256, entries), str(src_dir), dst, opts=opts)
    return result.bytes_sent


def _endpoint(site: XsiteSite, me: XsiteSite, sub: str) -> str:
    """`sub` under `site`'s state directory, as `me` reaches it (its own: the local path)."""
    if site.name == me.name:
        return str(_state(site) / sub)
    return f"{site.reach.rstrip('/')}/{sub}"


# ---- the tick ---------------------------------------------------------------------------------------------------
def tick(cfg: XsiteConfig, site_name: str, *, now: float | None = None) -> TickReport:
    me = cfg.site(site_name)
    if me is None:
        raise BadInput(f"--site {site_name}: not a site of {cfg.name} ({', '.join(s.name for s in cfg.sites)})")
    report = TickReport(site_name)
    state = _state(me)
    for sub in (OUTBOX, INBOX) + ((INCOMING, ROUNDS) if me.name == cfg.aggregator else ()):
        (state / sub).mkdir(parents=True, exist_ok=True)
    (state / LOCK_DIR).mkdir(exist_ok=True)
    fd = os.open(state / LOCK_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            token = tick_lock.acquire(fd, str(state / LOCK_DIR))
        except StageError as e:
            report.locked_out = str(e)
            return report
        try:
            _tick_locked(cfg, me, report, now if now is not None else time.time())
        finally:
            tick_lock.release(fd, token)
    finally:
        os.close(fd)
    with open(state / LOG, "a") as f:
        for e in report.events:
            f.write(json.dumps(e) + "\n")
    return report


def _tick_locked(cfg: XsiteConfig, me: XsiteSite, report: TickReport, now: float) -> None:
    from hpcscale.xsite.signing import load_keyring, load_private

    key = load_private(expand_path(me.key))
    keyring = load_keyring(expand_path(cfg.keys))
    aggregator = cfg.site(cfg.aggregator)
    assert aggregator is not None
    is_agg = me.name == aggregator.name
    if is_agg:
        _step("publish round 0", report, lambda: _publish_round0(cfg, me, key, report))
    _step("export", report, lambda: _export(cfg, me, key, keyring, report))
    _step("push contribution", report, lambda: _push_contribution(cfg, me, aggregator, report))
    if is_agg:
        _step("aggregate", report, lambda: _aggregate(cfg, me, key, keyring, report, now))
        for site in cfg.sites:
            _step(f"push round to {site.name}", report, lambda site=site: _push_round(cfg, me, site, report))
    _step("hand over", report, lambda: _hand_over(cfg, me, keyring, report))


def _step(name: str, report: TickReport, fn) -> None:
    """One stage of the tick: a failure is reported and the next stage still runs (a site that is down must
    not stop the rest of the tick); BadInput (a config or key problem) stops the tick."""
    try:
        fn()
    except BadInput:
        raise
    except Exception as e:
        report.errors.append(f"{name}: {type(e).__name__}: {e}")
        report.add("error", stage=name, error=f"{type(e).__name__}: {str(e)[:500]}")


# ---- 1. round 0 ------------------------------------------------------------------------------------------------
def _published(state: Path) -> list[int]:
    return sorted(int(m.group("round")) for p in (state / ROUNDS).iterdir() if (m := _ROUND.match(p.name)))


def _publish_round0(cfg: XsiteConfig, me: XsiteSite, key, report: TickReport) -> None:
    from hpcscale.xsite.roundfile import write_round

    state = _state(me)
    if _published(state):
        return
    start = [step for step, tag in _round_checkpoints(_run(me)) if tag["base_round"] == -1 and step == 0]
    if not start:
        return  # the aggregator's trainer has not saved its start yet
    theta = _consolidated(_run(me), start[0])
    write_round(
        state / ROUNDS,
        round=0,
        parent=None,
        outer=_outer(cfg),
        accepted=[],
        rejected=[],
        theta=theta,
        momentum={k: torch.zeros_like(v) for k, v in theta.items()},
        key=key,
    )
    report.add("published", round=0, from_step=start[0])


def _outer(cfg: XsiteConfig) -> dict[str, Any]:
    o = cfg.outer
    return {"lr": o.lr, "momentum": o.momentum, "nesterov": True, "rule": o.rule, "encoding": cfg.encoding}


# ---- 2-3. export and push this site's contribution --------------------------------------------------------------
def _verified_round(cfg: XsiteConfig, state: Path, keyring, r: int, where: str = INBOX):
    from hpcscale.xsite.roundfile import read_round

    path = state / where / f"{round_stem(r)}.json"
    if not path.exists():
        return None
    return read_round(path, keyring=keyring, aggregator=cfg.aggregator)


def _export(cfg: XsiteConfig, me: XsiteSite, key, keyring, report: TickReport) -> None:
    from hpcscale.xsite.outer import delta, encode
    from hpcscale.xsite.roundfile import write_contribution

    state = _state(me)
    newest: dict[int, tuple[int, dict]] = {}
    for step, tag in _round_checkpoints(_run(me)):
        if tag["base_round"] >= 0 and step > 0 and step % cfg.round_steps == 0:  # round checkpoints only
            newest[tag["base_round"]] = (step, tag)  # the newest checkpoint of each base round
    for base, (step, tag) in sorted(newest.items()):
        if (state / OUTBOX / f"{contrib_stem(me.name, base)}.json").exists():
            continue
        published = _verified_round(cfg, state, keyring, base)
        if published is None:
            report.add("waiting", reason=f"round {base} (the base of step {step}) is not in the inbox yet")
            continue
        d = delta(published.theta, _consolidated(_run(me), step))
        path = write_contribution(
            state / OUTBOX,
            site=me.name,
            base_round=base,
            steps=int(tag.get("steps", 0)),
            tokens=int(tag.get("tokens", 0)),
            encoding=cfg.encoding,
            tensors=encode(d, cfg.encoding),
            key=key,
        )
        report.add("exported", base_round=base, step=step, bytes=_pair_bytes(path))
        _fault("exported")


def _pair_bytes(json_path: Path) -> int:
    return sum(p.stat().st_size for p in (json_path, json_path.with_suffix(".safetensors")) if p.exists())


def _pair(json_path: Path) -> list[Path]:
    return [json_path.with_suffix(".safetensors"), json_path]  # the payload first, its JSON (the marker) last


def _push_contribution(cfg: XsiteConfig, me: XsiteSite, aggregator: XsiteSite, report: TickReport) -> None:
    outbox = _state(me) / OUTBOX
    mine = sorted(p for p in outbox.glob("contrib-*.json") if _CONTRIB.match(p.name))
    if not mine:
        return
    newest = mine[-1]
    sent_marker = outbox / f".pushed-{newest.stem}"
    if sent_marker.exists():
        return
    n = _push(cfg, _pair(newest), outbox, _endpoint(aggregator, me, f"{INCOMING}/{me.name}"))
    _fault("pushed")
    sent_marker.write_text(str(n))
    report.add("pushed", file=newest.name, to=aggregator.name, bytes=n)


# ---- 4. aggregate ------------------------------------------------------------------------------------------------
def _aggregate(cfg: XsiteConfig, me: XsiteSite, key, keyring, report: TickReport, now: float) -> None:
    from hpcscale.xsite.outer import OuterStep, aggregate, check_finite, decode, norm_outliers
    from hpcscale.xsite.roundfile import Rejected, read_contribution, write_round

    state = _state(me)
    published = _published(state)
    if not published:
        return
    r = published[-1] + 1
    arrived = [
        (site, path)
        for site in cfg.sites
        if (path := state / INCOMING / site.name / f"{contrib_stem(site.name, r - 1)}.json").exists()
        and path.with_suffix(".safetensors").exists()
    ]
    if not arrived:  # the usual cron tick: do not read and verify the whole base round for nothing
        return
    base = _verified_round(cfg, state, keyring, r - 1, where=ROUNDS)
    shapes = {k: tuple(v.shape) for k, v in base.theta.items()}
    valid: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
    rejected: list[dict[str, str]] = []
    for site, path in arrived:
        try:
            c = read_contribution(path, keyring=keyring, known_sites={s.name for s in cfg.sites},
                                  expected_base_round=r - 1)  # fmt: skip
            if c.site != site.name:
                raise Rejected(f"signed as {c.site} but pushed to {site.name}'s incoming directory")
            tensors = decode(c.tensors, c.encoding, shapes)
            problem = check_finite(tensors)
            if problem:
                raise Rejected(problem)
            valid[site.name] = (c, tensors)
        except Rejected as e:
            rejected.append({"site": site.name, "reason": str(e)})
        except BadInput as e:  # decode's refusal of a payload that does not fit the model
            rejected.append({"site": site.name, "reason": str(e)})
    seen = _read_json(state / REJECTED)
    fresh = [x for x in rejected if seen.get(f"{r}/{x['site']}") != x["reason"]]
    for x in fresh:  # each rejection reported once (every tick re-reads the incoming files)
        seen[f"{r}/{x['site']}"] = x["reason"]
        report.add("rejected", round=r, site=x["site"], reason=x["reason"])
    if fresh:
        _atomic_bytes(state / REJECTED, json.dumps(seen).encode())
    quorum = _read_json(state / QUORUM)
    first = quorum.get(str(r))
    if valid and first is None:
        first = now
        quorum[str(r)] = now
        _atomic_bytes(state / QUORUM, json.dumps(quorum).encode())
    waited = 0.0 if first is None else now - first
    ready = len(valid) >= cfg.quorum.min_sites or (valid and waited >= cfg.quorum.timeout_seconds)
    if not ready:
        if valid:  # nothing in yet is not news
            report.add("quorum", round=r, have=sorted(valid), need=cfg.quorum.min_sites, waited_s=round(waited, 1))
        return
    norms = {s: float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts.values()))) for s, (_, ts) in valid.items()}
    for s, reason in norm_outliers(norms, factor=cfg.outer.outlier_factor).items():
        rejected.append({"site": s, "reason": reason})
        valid.pop(s)
    if not valid:
        report.add("quorum", round=r, have=[], rejected=rejected)
        return
    weights = [float(c.tokens) if cfg.weighting == "tokens" and c.tokens > 0 else 1.0 for c, _ in valid.values()]
    mean = aggregate(list(zip(weights, [t for _, t in valid.values()], strict=True)), rule=cfg.outer.rule,
                     trim=cfg.outer.trim)  # fmt: skip
    outer = OuterStep.from_state(base.theta, base.momentum, lr=cfg.outer.lr, momentum=cfg.outer.momentum)
    outer.apply(mean)
    theta, momentum = outer.state()
    write_round(
        state / ROUNDS,
        round=r,
        parent=r - 1,
        outer=_outer(cfg),
        accepted=[
            {"site": s, "payload_sha256": c.payload_sha256, "tokens": c.tokens, "steps": c.steps}
            for s, (c, _) in valid.items()
        ],
        rejected=rejected,
        theta=theta,
        momentum=momentum,
        key=key,
    )
    _fault("published")
    report.add("published", round=r, accepted=sorted(valid), rejected=rejected, waited_s=round(waited, 1))


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


# ---- 5. push rounds; 6. hand over ---------------------------------------------------------------------------------
def _push_round(cfg: XsiteConfig, me: XsiteSite, site: XsiteSite, report: TickReport) -> None:
    rounds = _state(me) / ROUNDS
    published = _published(_state(me))
    if not published:
        return
    newest = rounds / f"{round_stem(published[-1])}.json"
    marker = rounds / f".pushed-{site.name}-{newest.stem}"
    if marker.exists():
        return
    n = _push(cfg, _pair(newest), rounds, _endpoint(site, me, INBOX))
    _fault("round_pushed")
    marker.write_text(str(n))
    report.add("pushed", file=newest.name, to=site.name, bytes=n)


def _hand_over(cfg: XsiteConfig, me: XsiteSite, keyring, report: TickReport) -> None:
    from safetensors.torch import save_file

    state = _state(me)
    found = sorted(int(m.group("round")) for p in (state / INBOX).iterdir() if (m := _ROUND.match(p.name)))
    if not found:
        return
    r = found[-1]
    run = _run(me)
    if not (run / "job.yaml").is_file():  # the job has not been started (its run directory is not made yet)
        report.add("waiting", reason=f"round {r} is here; {run} is not a run directory yet")
        return
    target = global_path(run, r)
    if target.exists():
        return
    published = _verified_round(cfg, state, keyring, r)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in published.theta.items()}, str(tmp), metadata={"round": str(r)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    _fault("handed")
    os.replace(tmp, target)
    report.add("handed over", round=r, run=str(run))


# ---- status ------------------------------------------------------------------------------------------------------
def status(cfg: XsiteConfig, site_name: str) -> dict[str, Any]:
    """This site's view: its log's rounds × sites, what is in its outbox, inbox and (aggregator) rounds."""
    me = cfg.site(site_name)
    if me is None:
        raise BadInput(f"--site {site_name}: not a site of {cfg.name}")
    state = _state(me)
    events = []
    with contextlib.suppress(OSError):
        for line in (state / LOG).read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    sent = sum(e.get("bytes", 0) for e in events if e.get("event") == "pushed")
    received = sum(p.stat().st_size for p in (state / INBOX).glob("round-*") if p.is_file())
    if me.name == cfg.aggregator:
        received += sum(p.stat().st_size for p in (state / INCOMING).glob("*/contrib-*") if p.is_file())
    waited = {e["round"]: e.get("waited_s") for e in events if e.get("event") == "published"}
    rounds: dict[int, dict[str, Any]] = {}
    if me.name == cfg.aggregator and (state / ROUNDS).is_dir():
        for r in _published(state):
            doc = _read_json(state / ROUNDS / f"{round_stem(r)}.json")
            rounds[r] = {
                "round": r,
                "accepted": doc.get("accepted", []),
                "rejected": doc.get("rejected", []),
                "created": doc.get("created"),
                "quorum_wait_s": waited.get(r),
            }
    return {
        "site": me.name,
        "aggregator": cfg.aggregator,
        "contributions": sorted(p.name for p in (state / OUTBOX).glob("contrib-*.json")),
        "inbox": sorted(p.name for p in (state / INBOX).glob("round-*.json")),
        "rounds": [rounds[r] for r in sorted(rounds)],
        "bytes_sent": sent,
        "bytes_received": received,
        "errors": [e for e in events if e.get("event") == "error"][-10:],
        "last_tick": events[-1]["time"] if events else None,
    }

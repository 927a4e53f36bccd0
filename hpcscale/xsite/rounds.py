"""Cross-site rounds: one `hpcscale sync` tick, run by cron on every site (docs/cross-site.md).

Files only, pushed by the side that owns them (a site never needs to list a remote directory):

    SITE.state/                       (every site, on its own filesystem)
      outbox/contrib-<site>-rNNNNNN.{json,safetensors}   this site's signed contributions
      inbox/round-NNNNNN.{json,safetensors}              rounds the aggregator pushed here
      log.jsonl                                          what each tick did (sync status reads it)
      TRAINING                                           the training this site follows (first round handed over)
      .hpcscale-stage/lock                               the tick lock (hpcscale.portable.lock)
    AGGREGATOR.state/ also
      incoming/<site>/contrib-...                        contributions the sites pushed
      rounds/round-NNNNNN.{json,safetensors}             published rounds: θ and momentum in one file
      outgoing/round-NNNNNN.{json,safetensors}           each round's site copy: θ only, signed (what is pushed)
      quorum.json                                        when each round's first valid contribution came
      rejected.json                                      contributions rejected, and why
    SITE.run/xsite/                                     made by the tick; only the user (or root) can write it
      global-rNNNNNN.safetensors                        θ(r), verified, for the trainer to adopt
      handed.json                                       the rounds handed over, each file's sha256 and size: what
                                                        the tick and the trainer go by, never a file name there
                                                        (hpcscale.xsite.handed)

A tick, in order; each step is idempotent, every file is written whole under a temporary name and renamed
(its JSON last), so a tick killed anywhere leaves a state the next one completes:
0. (aggregator) catch up: when its sites are ahead of it (its own run's record says it was handed, or its
   sites contribute against, a round it has not published: its state directory restored from an older copy),
   go on from the newest round every verified record agrees on, or publish nothing (steps 1 and 4) and say how
   to recover;
1. (aggregator) publish round 0 from its own run's start checkpoint (step 0, or the step its rounds started at:
   xsite.start_from), if not yet published;
2. export: each round checkpoint of this site's run (trainer state `xsite.base_round` = b, at a round
   boundary) whose contribution for b is not in the outbox becomes one: Δ = θ(b) − θ_site (this sign),
   encoded, hashed, signed; θ(b) is the verified round in the inbox;
3. push the newest contribution to the aggregator's incoming/<site>;
4. (aggregator) for the next round r: read every site's contribution for base r − 1, reject with a reason
   what fails (signature, hash, base round, shapes, finite values, norm bounds against the other sites'
   norms: outer.screen); apply the outer step once
   a quorum is in or the timeout has passed; publish round r (θ and m together, signed);
5. (aggregator) push the newest round's site copy (θ only: half the bytes; the momentum stays at the aggregator)
   to every site's inbox;
6. verify the newest round in the inbox and hand θ(r) to the run (θ, then the record naming it);
7. delete what is older than the newest `keep_rounds` rounds (rounds, site copies, inbox, contributions, the
   global weights handed over), so a long training does not fill the filesystem.
Two ticks at once on one site: the second finds the lock held and exits 0 saying so, so exactly one applies
a round. A site that is down does not stop the others: its push fails, is logged, and is retried next tick.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcscale.config.xsite import XsiteConfig, XsiteSite
from hpcscale.data.manifest import Manifest, entry_for
from hpcscale.errors import BadInput
from hpcscale.portable import lock as tick_lock
from hpcscale.portable.errors import StageError
from hpcscale.portable.files import append_json_lines, atomic_write
from hpcscale.portable.hashing import SHA256
from hpcscale.util.bounded import read_bounded, read_tail
from hpcscale.util.paths import expand_path
from hpcscale.util.trust import private_dir
from hpcscale.xsite import handed
from hpcscale.xsite.channel import parse_endpoint
from hpcscale.xsite.handed import GLOBAL_DIR, global_path
from hpcscale.xsite.roundfile import (
    FP32_MAX,
    THETA,
    Rejected,
    RejectedContribution,
    read_contribution,
    read_round,
    round_stem,
    theta_digest,
    training_id,
    write_contribution,
    write_round,
)
from hpcscale.xsite.roundfile import contribution_stem as contrib_stem  # one owner of the record names
from hpcscale.xsite.signing import load_keyring, load_private
from hpcscale.xsite.stage import StageOptions, stage_files

if TYPE_CHECKING:  # torch is imported where tensors are handled: an idle tick needs none of it (1 s)
    import torch

OUTBOX, INBOX, INCOMING, ROUNDS, OUTGOING = "outbox", "inbox", "incoming", "rounds", "outgoing"
LOG = "log.jsonl"
QUORUM = "quorum.json"
REJECTED = "rejected.json"  # (aggregator) what was rejected and why: reported once
TRAINING = "TRAINING"  # (every site) the training this site follows, from the first round it handed over
RESEND_MIN_S = 600.0  # a push unanswered this long (or the quorum timeout, if longer) is sent again
LOCK_DIR = ".hpcscale-stage"  # the same directory name the stage lock uses: one lock per state directory
TAG = "xsite"  # trainer_state key of a round checkpoint: {"base_round": b, "steps": n, "tokens": t}
_CONTRIB = re.compile(r"^contrib-(?P<site>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})-r(?P<base>\d{6})\.json$")
_ROUND = re.compile(r"^round-(?P<round>\d{6})\.json$")


def latest_global(run: Path) -> int | None:
    """The newest round handed to `run`, as the tick's record says (never a file name in RUN/xsite); None when
    none was. handed.RecordError when that record is not to be trusted."""
    entry = handed.latest(run)
    return None if entry is None else entry.round


def load_global(run: Path, r: int) -> dict[str, torch.Tensor]:
    """θ(r) handed to `run`, from the file the record names, checked against its digest (handed.load)."""
    entry = next((e for e in handed.entries(run) if e.round == r), None)
    if entry is None:
        raise handed.Refused(f"{run / GLOBAL_DIR / handed.RECORD}: round {r} was not handed to this run (or is no "
                             "longer kept)")  # fmt: skip
    return handed.load(run, entry)


@dataclass
class TickReport:
    site: str
    locked_out: str | None = None  # another tick held the lock: who
    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, event: str, **fields: Any) -> None:
        self.events.append({"time": round(time.time(), 3), "site": self.site, "event": event, **fields})

    def error_once(self, stage: str, error: str) -> None:
        """A stage's failure, said once in this tick however many stages meet it (`sync` exits 1)."""
        line = f"{stage}: {error}"
        if line not in self.errors:
            self.errors.append(line)
            self.add("error", stage=stage, error=error[:500])


# ---- helpers ----------------------------------------------------------------------------------------------------
def _state(site: XsiteSite) -> Path:
    return expand_path(site.state)


def _run(site: XsiteSite) -> Path:
    return expand_path(site.run)


def _handed(me: XsiteSite, report: TickReport) -> int | None:
    """The newest round this site's tick handed to its run, from its record (None: none). A record or RUN/xsite
    that is not to be trusted is reported (once a tick, every tick) and counts as none: it stops no stage."""
    try:
        return latest_global(_run(me))
    except handed.RecordError as e:
        report.error_once("hand over", str(e))
        return None


FAULT_POINTS = ("exported", "pushed", "published", "round_pushed", "handed")


def _fault(point: str) -> None:
    """Crash tests: HPCSCALE_XSITE_FAULT=<point> SIGKILLs the tick there (one environment lookup otherwise)."""
    if os.environ.get("HPCSCALE_XSITE_FAULT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _round_checkpoints(run: Path) -> list[tuple[int, dict]]:
    """(step, xsite tag) of every committed checkpoint of the run that is a round checkpoint, oldest first."""
    from hpcscale.ckpt.format import (  # lazy: loads numpy, which this module avoids
        INDEX,
        committed_steps,
        read_index,
        step_dir_name,
    )

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


def _start(tag: dict) -> int:
    """The step a run's rounds started at: 0, or (xsite.start_from) the step of the checkpoint it started from."""
    start = tag.get("start", 0)
    return start if type(start) is int and start >= 0 else 0


def _consolidated(run: Path, step: int) -> dict[str, torch.Tensor]:
    from hpcscale.ckpt.export import consolidated  # lazy: loads torch, kept off `hpcscale sync`
    from hpcscale.ckpt.format import step_dir_name  # lazy: loads numpy, which this module avoids

    return {k: v.float() for k, v in consolidated(run / "checkpoints" / step_dir_name(step)).items()}


def _push(cfg: XsiteConfig, files: list[Path], src_dir: Path, dst: str) -> int:
    """Stage `files` (in src_dir) to the endpoint `dst` with the staging transports; bytes sent."""

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
def tick(cfg: XsiteConfig, site_name: str, *, now: float | None = None, clock: TickClock | None = None) -> TickReport:
    """One tick for `site_name`. `now` or `clock` (tests) stand for this host's clocks."""
    me = cfg.site(site_name)
    if me is None:
        raise BadInput(f"--site {site_name}: not a site of {cfg.name} ({', '.join(s.name for s in cfg.sites)})")
    report = TickReport(site_name)
    state = _state(me)
    _state_dirs(cfg, me)
    fd = os.open(state / LOCK_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            token = tick_lock.acquire(fd, str(state / LOCK_DIR))
        except StageError as e:
            report.locked_out = str(e)
            return report
        try:
            try:
                _tick_locked(cfg, me, report, clock or TickClock.read(now))
            finally:  # under the lock: the log's rotation cannot drop another tick's lines
                try:
                    _append_log(state, report.events)
                except OSError as e:  # a full disk loses the log's lines, not the tick (its events are printed)
                    report.errors.append(f"log: cannot append to {state / LOG}: {e.strerror}")
        finally:
            tick_lock.release(fd, token)
    finally:
        os.close(fd)
    return report


STATE_WHAT = "cross-site sync state directory"


def _state_dirs(cfg: XsiteConfig, me: XsiteSite) -> None:
    """The state directory and those in it the tick keeps its records in, made by the tick (a mkdir that fails
    when the name exists, mode 0755 whatever the umask) or kept only if they are the user's or root's and
    writable by no one else, checked on the descriptor (hpcscale.util.trust.private_dir): the names in them (a
    round record in rounds/, a push marker, TRAINING) are what the tick goes by, and one planted there by
    someone else would stop or mislead it (a round-999999.json in rounds/ stopped publishing). Otherwise
    UntrustedFile, exit 2, before anything in them is read. Every site's incoming/ directory is made here too,
    before a push makes it with the pushing session's umask."""

    state = Path(os.path.realpath(_state(me)))  # a state path that is a symbolic link: the directory it leads to
    subs = [OUTBOX, INBOX, LOCK_DIR]
    if me.name == cfg.aggregator:
        subs += [ROUNDS, OUTGOING, INCOMING] + [f"{INCOMING}/{s.name}" for s in cfg.sites]
    for sub in subs:  # each from state's parent down: state itself is checked again on every descriptor
        private_dir(state / sub, what=STATE_WHAT, mode=0o755, below=state.parent)


LOG_MAX_BYTES = 16 << 20  # log.jsonl past this keeps its newest half (sync status reads the newest rounds)


def _append_log(state: Path, events: list[dict[str, Any]]) -> None:
    """Append to log.jsonl (hpcscale.portable.files.append_json_lines: never through a planted symlink, only a
    regular file, one write per line), keeping its newest half once it passes LOG_MAX_BYTES."""
    if not events:
        return
    path = state / LOG
    size = append_json_lines(path, events)
    if size > LOG_MAX_BYTES:
        tail = read_tail(path, max_bytes=LOG_MAX_BYTES // 2, what="sync log")
        atomic_write(path, tail.data)  # whole lines (read_tail drops the one the cut falls in)


def _tick_locked(cfg: XsiteConfig, me: XsiteSite, report: TickReport, clock: TickClock) -> None:
    key = load_private(expand_path(me.key))
    keyring = load_keyring(expand_path(cfg.keys))
    aggregator = cfg.site(cfg.aggregator)
    assert aggregator is not None
    is_agg = me.name == aggregator.name
    caught_up: list[bool] = []  # (aggregator) whether it may publish: not behind its sites, or caught up
    if is_agg:
        _step("catch up", report, lambda: caught_up.append(_catch_up(cfg, me, key, keyring, report)))
        if caught_up == [True]:  # a catch-up that failed says nothing: publishing then could fork the rounds
            _step("publish round 0", report, lambda: _publish_round0(cfg, me, key, report))
    _step("export", report, lambda: _export(cfg, me, key, keyring, report))
    _step("push contribution", report, lambda: _push_contribution(cfg, me, aggregator, report, clock))
    if is_agg:
        if caught_up == [True]:
            _step("aggregate", report, lambda: _aggregate(cfg, me, key, keyring, report, clock))
        for site in cfg.sites:
            push = lambda site=site: _push_round(cfg, me, site, key, keyring, report, clock)  # noqa: E731
            _step(f"push round to {site.name}", report, push)
    _step("hand over", report, lambda: _hand_over(cfg, me, keyring, report))
    _step("prune", report, lambda: _prune(cfg, me, report))


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
def _rounds_in(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m.group("round")) for p in directory.iterdir() if (m := _ROUND.match(p.name)))


def _published(state: Path) -> list[int]:
    return _rounds_in(state / ROUNDS)


def _verified_rounds(cfg: XsiteConfig, me: XsiteSite, report: TickReport) -> list[int]:
    """The rounds retention counts from: only what was verified, never a name that merely appeared in the inbox
    (a stray `round-999999.json` there must not make every real round "old"). The aggregator: the rounds it
    published itself; a site: the newest round its tick verified and handed to its run."""
    if me.name == cfg.aggregator:
        return _published(_state(me))
    newest = _handed(me, report)
    return [] if newest is None else [newest]


def _oldest_kept(cfg: XsiteConfig, rounds: list[int]) -> int:
    return max(0, rounds[-1] - cfg.keep_rounds + 1) if rounds else 0


def _write_fresh_round(state: Path, cfg: XsiteConfig, r: int, theta: dict, key, *, training: str) -> None:
    """Round r holding θ and no contributions, its outer momentum zero: the first round, or one an aggregator
    behind its sites takes over (its momentum was in the rounds it lost)."""
    import torch

    momentum = {k: torch.zeros_like(v) for k, v in theta.items()}
    write_round(state / ROUNDS, round=r, parent=None if r == 0 else r - 1, outer=_outer(cfg), accepted=[],
                rejected=[], theta=theta, momentum=momentum, key=key, training=training)  # fmt: skip


def _publish_round0(cfg: XsiteConfig, me: XsiteSite, key, report: TickReport) -> None:
    state = _state(me)
    if _published(state):
        return
    start = [step for step, tag in _round_checkpoints(_run(me)) if tag["base_round"] == -1 and step == _start(tag)]
    if not start:
        return  # the aggregator's trainer has not saved its start yet

    theta = _consolidated(_run(me), start[0])
    # every later record of this training names it
    _write_fresh_round(state, cfg, 0, theta, key, training=training_id(cfg.name, theta))
    report.add("published", round=0, from_step=start[0])


def _outer(cfg: XsiteConfig) -> dict[str, Any]:
    o = cfg.outer
    return {"lr": o.lr, "momentum": o.momentum, "nesterov": True, "rule": o.rule, "encoding": cfg.encoding}


# ---- 1b. an aggregator behind its sites --------------------------------------------------------------------------
# Its state directory restored from an older copy (or rounds lost), an aggregator's newest round is older than
# what its sites train from: their contributions are against rounds it does not have, and without this it would
# never publish again, or publish a second, different round R + 1 (a fork) from contributions its backup held.
BEHIND = "!behind"  # rejected.json key "R/!behind": what this aggregator said about being behind, said once


@dataclass(frozen=True, slots=True)
class Ahead:
    """What names rounds past this aggregator's newest (nothing verified yet): the newest contribution file of
    each site against such a round and the newest round records in its inbox/ and outgoing/, by file name, and
    the newest round its own run was handed, by its tick's record."""

    newest: int  # this aggregator's newest published round (-1: none)
    handed: int | None  # its run's newest global round, when past `newest`
    contributions: dict[str, tuple[int, Path]]  # site -> (base round, file)
    copies: list[tuple[int, Path]]  # (round, record file)


def _ahead_by_name(cfg: XsiteConfig, me: XsiteSite, state: Path, newest: int, report: TickReport) -> Ahead | None:
    """None when nothing names a round past `newest` (every usual tick: a few directory listings). One file per
    site and directory is considered, its newest: a partner filling its incoming/ with names costs nothing. The
    round its own run was handed is its tick's record's, never a name in RUN/xsite (one planted there would
    stop this aggregator publishing for ever)."""
    handed_round = _handed(me, report)
    contributions = {}
    for site in cfg.sites:
        found = [
            (int(m.group("base")), p)
            for p in (state / INCOMING / site.name).glob("contrib-*.json")
            if (m := _CONTRIB.match(p.name)) and m.group("site") == site.name and int(m.group("base")) > newest
        ]
        if found:
            contributions[site.name] = max(found)
    copies = [(r[-1], state / sub / f"{round_stem(r[-1])}.json") for sub in (INBOX, OUTGOING)
              if (r := _rounds_in(state / sub)) and r[-1] > newest]  # fmt: skip
    handed_round = handed_round if handed_round is not None and handed_round > newest else None
    if handed_round is None and not contributions and not copies:
        return None
    return Ahead(newest, handed_round, contributions, copies)


def _catch_up(cfg: XsiteConfig, me: XsiteSite, key, keyring, report: TickReport) -> bool:
    """(aggregator) True when it may publish. When sites are ahead of it, adopt the newest round R past its own
    that every verified record agrees on, from θ(R) signed by its own key (a round record in its inbox/ or
    outgoing/), or from θ(R) in its own run's xsite/ whose digest the sites' signed contributions against R
    name (and no verified contribution names another); the round is written again with the outer momentum
    restarted from zero (it was in the rounds lost). Otherwise say what is ahead and how to recover, in the log
    once and in `sync status`; while this aggregator's own run or its own signed record shows a newer round,
    it publishes nothing (that would fork the rounds). A partner alone naming a newer round is reported and
    does not stop the training: its key can sign any number."""
    state = _state(me)
    published = _published(state)
    newest = published[-1] if published else -1
    ahead = _ahead_by_name(cfg, me, state, newest, report)
    if ahead is None:
        _say_behind(state, newest, None, report)
        return True

    ours = None  # this aggregator's newest round's record, verified (its training, θ's names and shapes)
    if published:
        try:  # its JSON only: a partner naming a newer round every tick must not cost a read of θ every tick
            ours = read_round(state / ROUNDS / f"{round_stem(newest)}.json", keyring=keyring,
                              aggregator=cfg.aggregator, payload=False)  # fmt: skip
        except Rejected as e:
            report.errors.append(f"catch up: round {newest}, this aggregator's newest, does not verify: {e.reason}")
            return False
    named: dict[int, dict[str | None, list[str]]] = {}  # base round -> θ digest -> the sites naming it
    trainings = set()
    for site, (b, path) in sorted(ahead.contributions.items()):
        try:
            c = read_contribution(path, keyring=keyring, known_sites={site}, payload=False)
        except Rejected:
            continue  # not a record of this site: it names nothing (the aggregation says why, in its round)
        if c.base_round == b and _same_training(cfg, ours, c.training):
            named.setdefault(b, {}).setdefault(c.base_theta_sha256, []).append(site)
            trainings.add(c.training)
    signed = {}
    for r, path in ahead.copies:
        with contextlib.suppress(Rejected):
            copy = read_round(path, keyring=keyring, aggregator=cfg.aggregator, expected_round=r)
            if _same_training(cfg, ours, copy.training):
                signed[r] = copy
                trainings.add(copy.training)
    training = ours.training if ours is not None else next(iter(trainings)) if len(trainings) == 1 else None
    if ours is not None or training is not None:  # records of two trainings and no round here: adopt neither
        candidates = set(named) | set(signed) | ({ahead.handed} if ahead.handed is not None else set())
        for r in sorted(candidates, reverse=True):
            if _adopt(cfg, me, key, report, ours, training, r, named.get(r, {}), signed.get(r)):
                _say_behind(state, newest, None, report)
                return True
    blocking = ahead.handed is not None or bool(signed)
    _say_behind(state, newest, _behind_message(cfg, me, ahead, named, signed, blocking), report)
    if blocking:  # every tick: `sync` exits 1, and cron says so
        report.errors.append(str(_read_json(state / REJECTED).get(f"{newest + 1}/{BEHIND}")))
    return not blocking


def _same_training(cfg: XsiteConfig, ours, theirs: str | None) -> bool:
    """Whether a record's training is that of `ours` (this aggregator's newest round, None: none left here), or,
    with no round here to say, one of this config's name."""
    if ours is not None:
        return theirs == ours.training
    return theirs is not None and theirs.rsplit(":", 1)[0] == cfg.name


def _adopt(cfg: XsiteConfig, me: XsiteSite, key, report: TickReport, ours, training, r: int, digests, copy) -> bool:
    """Write round r again from θ(r) that the records agree on (see _catch_up); False when they do not. `ours`:
    this aggregator's newest round (None: none), `digests`: θ digest -> the sites whose verified contribution
    against r names it, `copy`: round r signed by this aggregator's key, verified (None: none here)."""
    if len(digests) > 1 or None in digests:  # verified contributions disagree on θ(r), or name none
        return False
    entry = None
    if copy is None:
        with contextlib.suppress(handed.RecordError):  # reported by _handed already
            entry = next((e for e in handed.entries(_run(me)) if e.round == r), None)
        if not digests or entry is None:
            return False  # nothing to adopt θ(r) from (and no torch loaded to find that out)
    from hpcscale.xsite.outer import check_outer_result  # lazy: loads torch, kept off `hpcscale sync`

    if copy is not None:
        theta, source = copy.theta, f"{copy.path} (signed by this aggregator's key)"
    else:
        try:  # the file its record names, checked against the record's digest
            theta = {k: v.float() for k, v in handed.load(_run(me), entry).items()}
        except (handed.Refused, handed.RecordError):
            return False
        sites = ", ".join(next(iter(digests.values())))
        source = f"{global_path(_run(me), r)}, whose θ digest {sites} named in their signed contributions"
    if digests and theta_digest(theta) not in digests:
        return False
    shapes = {k: tuple(v.shape) for k, v in theta.items()}
    if ours is not None:  # θ's names and shapes: this training's, as its newest round here lists them
        known = {n.removeprefix(THETA): spec.shape for n, spec in ours.specs.items() if n.startswith(THETA)}
        if shapes != known:
            return False
    if check_outer_result(theta, {}):
        return False
    _write_fresh_round(_state(me), cfg, r, theta, key, training=training)
    report.add("caught up", round=r, after=-1 if ours is None else ours.round, source=source,
               momentum="restarted from zero (it was in the rounds lost)")  # fmt: skip
    return True


def _say_behind(state: Path, newest: int, message: str | None, report: TickReport) -> None:
    """Record (once: in the log when it changes) or clear what this aggregator says about being behind."""
    seen = _read_json(state / REJECTED)
    key = f"{newest + 1}/{BEHIND}"
    stale = [k for k in seen if k.endswith(f"/{BEHIND}") and (k != key or message is None)]
    if message is None and not stale:
        return
    for k in stale:
        del seen[k]
    if message is not None and seen.get(key) != message:
        seen[key] = message
        report.add("behind", round=newest, reason=message)
    atomic_write(state / REJECTED, json.dumps(seen).encode())


def _behind_message(cfg: XsiteConfig, me: XsiteSite, ahead: Ahead, named, signed, blocking: bool) -> str:
    """What is ahead of this aggregator, and the exact way back."""
    state = _state(me)
    seen = []
    if ahead.handed is not None:
        seen.append(f"its own run was handed round {ahead.handed} ({global_path(_run(me), ahead.handed)})")
    for b in sorted(named, reverse=True):
        sites = sorted(s for group in named[b].values() for s in group)
        seen.append(f"{', '.join(sites)} sent a signed contribution against round {b}")
    for r in sorted(signed, reverse=True):
        seen.append(f"a round {r} signed by its key is in {signed[r].path.parent}")
    unverified = sorted(
        s for s, (b, _) in ahead.contributions.items() if not any(s in g for g in named.get(b, {}).values())
    )
    if unverified:
        seen.append(f"contribution files of {', '.join(unverified)} name newer rounds but do not verify")
    target = max([-1 if ahead.handed is None else ahead.handed, *named, *signed])
    newest = "none" if ahead.newest < 0 else f"round {ahead.newest}"
    head = (
        f"sites are ahead of this aggregator: its newest published round is {newest}, but "
        + "; ".join(seen)
        + f". Its state directory ({state}) was probably restored from an older copy, or rounds/ lost."
    )
    donors = [s for s in cfg.sites if s.name != me.name and any(s.name in g for g in named.get(target, {}).values())]
    donor = (donors or [s for s in cfg.sites if s.name != me.name] or [me])[0]
    how = (
        f" To go on from round {target}: copy round-{target:06d}.json and round-{target:06d}.safetensors from "
        f"the inbox of a site that has it into {state / INBOX}/, e.g. from {donor.name}: "
        f"`{_fetch_command(donor, target, state / INBOX)}`; the next tick checks this aggregator's signature on "
        f"it and publishes round {target + 1} on from it."
    )
    if blocking and ahead.handed is not None and not named.get(ahead.handed):
        how += (
            f" Or wait: once a site's signed contribution against round {ahead.handed} confirms the θ in "
            f"{global_path(_run(me), ahead.handed)}, it goes on by itself (a site sends its contribution again "
            f"after {_resend_after(cfg):.0f} s unanswered)."
        )
    if blocking:
        how += " Until then it publishes nothing: a round from its older state would fork the training."
    else:
        how += (
            " It goes on publishing meanwhile (only another site's records say so: a site's key can sign any "
            "round number); a site ahead of it adopts its rounds once they pass the one it has."
        )
    return head + how


def _fetch_command(site: XsiteSite, r: int, dest: Path) -> str:
    """The command that copies round r's record from `site`'s inbox into `dest` (shown, never run)."""
    import shlex

    names = [f"{round_stem(r)}.json", f"{round_stem(r)}.safetensors"]
    try:
        ep = parse_endpoint(site.reach)
    except BadInput:
        ep = None
    if ep is not None and ep.kind == "ssh":
        host = f"{ep.user}@{ep.host}" if ep.user else ep.host
        port = f"-P {ep.port} " if ep.port else ""
        sources = " ".join(shlex.quote(f"{host}:{ep.path.rstrip('/')}/{INBOX}/{n}") for n in names)
        return f"scp {port}{sources} {shlex.quote(str(dest))}/"
    root = _state(site) if ep is None else Path(ep.path)
    return f"cp {' '.join(shlex.quote(str(root / INBOX / n)) for n in names)} {shlex.quote(str(dest))}/"


# ---- 2-3. export and push this site's contribution --------------------------------------------------------------
def _verified_round(cfg: XsiteConfig, state: Path, keyring, r: int, where: str = INBOX, need_momentum: bool = False):
    path = state / where / f"{round_stem(r)}.json"
    if not path.exists():
        return None
    return read_round(path, keyring=keyring, aggregator=cfg.aggregator, need_momentum=need_momentum)


def _export(cfg: XsiteConfig, me: XsiteSite, key, keyring, report: TickReport) -> None:
    state = _state(me)
    newest: dict[int, tuple[int, dict]] = {}
    for step, tag in _round_checkpoints(_run(me)):
        if tag["base_round"] >= 0 and step > _start(tag) and (step - _start(tag)) % cfg.round_steps == 0:
            newest[tag["base_round"]] = (step, tag)  # the newest checkpoint of each base round
    oldest = _oldest_kept(cfg, _verified_rounds(cfg, me, report))
    newest_handed = _handed(me, report)
    for base, (step, tag) in sorted(newest.items()):
        stem = contrib_stem(me.name, base)
        if (
            base < oldest
            # too late for any round: the last it could be folded into (quorum.late_rounds) was handed over already
            or (newest_handed is not None and base + 1 + cfg.quorum.late_rounds <= newest_handed)
            or (state / OUTBOX / f"{stem}.json").exists()
            or (state / OUTBOX / f".skipped-{stem}").exists()
        ):
            continue  # contributed (or found it cannot) already, or its base round is no longer kept
        published = _verified_round(cfg, state, keyring, base)
        if published is None:
            report.add("waiting", reason=f"round {base} (the base of step {step}) is not in the inbox yet")
            continue
        foreign = _foreign(cfg, state, published)
        if foreign:
            report.add("waiting", reason=f"round {base} in the inbox cannot be a base: {foreign}")
            continue
        from hpcscale.xsite.outer import check_finite, delta, encode  # lazy: loads torch, kept off `hpcscale sync`

        try:
            d = delta(published.theta, _consolidated(_run(me), step))
            problem = check_finite(d)
            if problem:
                raise BadInput(problem)
            tensors = encode(d, cfg.encoding)
        except BadInput as e:  # this round's Δ cannot be sent; the tick goes on (a later round's can)
            reason = f"no contribution for round {base + 1}: {e}"
            atomic_write(state / OUTBOX / f".skipped-{stem}", reason.encode())  # decided once, not every tick
            report.add("skipped", base_round=base, step=step, reason=reason)
            continue
        path = write_contribution(
            state / OUTBOX,
            site=me.name,
            base_round=base,
            steps=int(tag.get("steps", 0)),
            tokens=int(tag.get("tokens", 0)),
            encoding=cfg.encoding,
            tensors=tensors,
            key=key,
            compression=cfg.compression,
            training=published.training,
            base_theta_sha256=theta_digest(published.theta) if published.training else None,
        )
        report.add("exported", base_round=base, step=step, bytes=_pair_bytes(path))
        _fault("exported")


def _pair_bytes(json_path: Path) -> int:
    return sum(p.stat().st_size for p in (json_path, json_path.with_suffix(".safetensors")) if p.exists())


def _pair(json_path: Path) -> list[Path]:
    return [json_path.with_suffix(".safetensors"), json_path]  # the payload first, its JSON (the marker) last


def _resend_after(cfg: XsiteConfig) -> float:
    """How long a push may go unanswered before it is sent again (RESEND_MIN_S, or the quorum timeout)."""
    return max(float(cfg.quorum.timeout_seconds), RESEND_MIN_S)


def _unanswered(marker: Path, answered: bool, cfg: XsiteConfig, clock: TickClock) -> str | None:
    """Why a pushed record must be pushed again (None: it need not): its push marker says it went, but what the
    other end does once it has it (the next round, the site's next contribution) has not come for longer than
    _resend_after. A file lost at the other end after its push (deleted, a restored backup) is then sent again;
    a push that merely waits on slow training costs one verified no-op stage."""
    if answered:
        return None
    try:
        text = read_bounded(marker, max_bytes=4096, what="push marker")
        mtime = marker.stat().st_mtime
    except (BadInput, OSError):  # missing, or not a marker this tick wrote: push (again)
        return "not pushed yet"
    try:  # the tick's clock at the push; a marker from before it held only the bytes: its mtime then
        at = float(json.loads(text)["at"])
    except (ValueError, KeyError, TypeError, OverflowError):
        at = mtime
    age = clock.wall - at
    if age < _resend_after(cfg):
        return None
    return f"pushed {age:.0f} s ago and not answered: sending it again (the other end may have lost it)"


def _push_contribution(
    cfg: XsiteConfig, me: XsiteSite, aggregator: XsiteSite, report: TickReport, clock: TickClock
) -> None:
    state = _state(me)
    outbox = state / OUTBOX
    mine = sorted(p for p in outbox.glob("contrib-*.json") if _CONTRIB.match(p.name))
    if not mine:
        return
    newest = mine[-1]
    base = int(_CONTRIB.match(newest.name).group("base"))
    newest_handed = _handed(me, report)
    # answered: a newer round was verified and handed over, as the tick's record says (not a name in the inbox
    # or in RUN/xsite, which anyone who can write there could plant to stop the resending)
    answered = newest_handed is not None and newest_handed > base
    sent_marker = outbox / f".pushed-{newest.stem}"
    why = _unanswered(sent_marker, answered, cfg, clock)
    if why is None:
        return
    n = _push(cfg, _pair(newest), outbox, _endpoint(aggregator, me, f"{INCOMING}/{me.name}"))
    _fault("pushed")
    atomic_write(sent_marker, json.dumps({"bytes": n, "at": clock.wall}).encode())  # replaces a planted link
    again = {} if why == "not pushed yet" else {"again": why}
    report.add("pushed", file=newest.name, to=aggregator.name, bytes=n, **again)


# ---- 4. aggregate ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TickClock:
    """When a tick runs: the wall clock (recorded, shown), and the time since boot with the boot's id, which
    no clock step moves. A quorum's wait is measured on the boot clock when the round's first contribution
    came in this boot; across a reboot only the wall clock is left, and a start it puts in the future (the
    clock stepped back) restarts the wait from now, so a timeout is late by at most one timeout."""

    wall: float
    boot: str
    uptime: float

    @classmethod
    def read(cls, now: float | None = None) -> TickClock:
        """This host's clocks; `now` (tests) stands for both the wall clock and the boot clock."""
        if now is not None:
            return cls(now, "given", now)
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
        except (OSError, AttributeError):
            boot, uptime = "", 0.0
        return cls(time.time(), boot, uptime)

    def stamp(self) -> dict[str, Any]:
        return {"wall": self.wall, "boot": self.boot, "uptime": self.uptime}

    def waited(self, stamp: Any) -> float | None:
        """Seconds since `stamp` (a quorum.json entry: this class's stamp, or an older bare wall time); None
        when the stamp is in the future on the wall clock and no boot clock can say (restart the wait)."""
        if isinstance(stamp, dict) and stamp.get("boot") and stamp.get("boot") == self.boot:
            up = stamp.get("uptime")
            if isinstance(up, int | float) and math.isfinite(up):
                return max(0.0, self.uptime - float(up))
        wall = stamp.get("wall") if isinstance(stamp, dict) else stamp
        if not isinstance(wall, int | float) or isinstance(wall, bool) or not math.isfinite(wall):
            return None
        return None if wall > self.wall else self.wall - float(wall)


@dataclass(frozen=True, slots=True)
class Arrival:
    """A site's newest contribution file for this round (or, late, an older base) not decided yet."""

    site: XsiteSite
    base: int
    path: Path


@dataclass(frozen=True, slots=True)
class Checked:
    """A contribution that verified (signature, base, shapes, finite values), decoded to fp32, with ‖Δ‖."""

    contribution: Any  # roundfile.Contribution
    tensors: dict[str, torch.Tensor]
    norm: float

    @property
    def site(self) -> str:
        return self.contribution.site


def _aggregate(cfg: XsiteConfig, me: XsiteSite, key, keyring, report: TickReport, clock: TickClock) -> None:
    """Round r = the newest published + 1, in steps that each own one rule: what arrived (_arrivals), what
    verifies (_check), what no honest site could send (_screen: refused, or cut to the usual size), whether the
    quorum of what is left is in (_quorum: refused contributions neither count nor start its clock), how they
    combine (_combine), and that what the outer step gives is finite and bounded before it is signed."""
    state = _state(me)
    published = _published(state)
    if not published:
        return
    r = published[-1] + 1
    oldest = max(0, r - 1 - cfg.quorum.late_rounds)
    arrived = _arrivals(cfg, state, r, oldest)
    if not any(a.base == r - 1 for a in arrived):
        return  # the usual cron tick: do not read and verify the whole base round for nothing (late ones wait)
    from hpcscale.xsite.outer import OuterStep, check_outer_result  # lazy: loads torch, kept off `hpcscale sync`

    base = _verified_round(cfg, state, keyring, r - 1, where=ROUNDS, need_momentum=True)
    valid, rejected = _check(cfg, arrived, base, keyring, r, oldest)
    screened = _screen(cfg, state, r, base, valid)
    rejected += [
        RejectedContribution(site=c.site, reason=screened.rejected[c.site], base_round=c.contribution.base_round)
        for c in valid
        if c.site in screened.rejected
    ]
    valid = [_clip(c, screened.clipped[c.site][0]) if c.site in screened.clipped else c for c in valid]
    valid = [c for c in valid if c.site not in screened.rejected]
    _report_rejections(state, r, rejected, report)
    on_time = sorted(c.site for c in valid if c.contribution.base_round == r - 1)  # a late one never decides
    ready, waited = _quorum(cfg, state, r, on_time, clock)
    if not ready:
        if valid:  # nothing in yet is not news
            report.add("quorum", round=r, have=on_time, need=cfg.quorum.min_sites, waited_s=round(waited, 1))
        return
    outer = OuterStep.from_state(base.theta, base.momentum, lr=cfg.outer.lr, momentum=cfg.outer.momentum)
    outer.apply(_combine(cfg, valid))
    theta, momentum = outer.state()
    problem = check_outer_result(theta, momentum)
    if problem:  # never signed: the round waits (every contribution kept its bounds, so this is a bug's mark)
        seen = _read_json(state / REJECTED)
        if seen.get(f"{r}/!outer") != problem:  # said once, like a rejection
            seen[f"{r}/!outer"] = problem
            atomic_write(state / REJECTED, json.dumps(seen).encode())
            report.add("not published", round=r, reason=problem, accepted=sorted(c.site for c in valid))
        return
    write_round(
        state / ROUNDS,
        round=r,
        parent=r - 1,
        outer=_outer(cfg),
        accepted=[
            {
                "site": c.site,
                "payload_sha256": c.contribution.payload_sha256,
                "tokens": c.contribution.tokens,
                "steps": c.contribution.steps,
                "base_round": c.contribution.base_round,
                "norm": c.norm,  # as applied (after a cut): what the next rounds' history bound is made of
            }
            for c in valid
        ],
        rejected=rejected,
        theta=theta,
        momentum=momentum,
        key=key,
        training=base.training,
    )
    _fault("published")
    late = {c.site: c.contribution.base_round for c in valid if c.contribution.base_round != r - 1}
    clipped = {s: round(f, 6) for s, (f, _) in screened.clipped.items() if s in {c.site for c in valid}}
    report.add("published", round=r, accepted=sorted(c.site for c in valid),
               rejected=[_rejected_json(x) for x in rejected], waited_s=round(waited, 1),
               **({"late": late} if late else {}), **({"clipped": clipped} if clipped else {}))  # fmt: skip


def _clip(c: Checked, factor: float) -> Checked:
    """A contribution scaled down to the history bound (outer.screen)."""
    return Checked(c.contribution, {k: v * factor for k, v in c.tensors.items()}, c.norm * factor)


def _rejected_json(x) -> dict[str, Any]:
    return {"site": x.site, "reason": x.reason, "base_round": x.base_round}


def _arrivals(cfg: XsiteConfig, state: Path, r: int, oldest: int) -> list[Arrival]:
    """Each site's newest contribution with a base in [oldest, r − 1] that no published round decided yet."""
    used = _decided(state, range(oldest + 1, r))  # (site, base) a round applied or refused: never tried again
    arrived = []
    for site in cfg.sites:
        for b in range(r - 1, oldest - 1, -1):
            path = state / INCOMING / site.name / f"{contrib_stem(site.name, b)}.json"
            if (site.name, b) in used:
                break  # a newer one was decided already: an older one is superseded
            if path.exists() and path.with_suffix(".safetensors").exists():
                arrived.append(Arrival(site, b, path))
                break
    return arrived


def _check(cfg: XsiteConfig, arrived: list[Arrival], base, keyring, r: int, oldest: int):
    """(what verifies, decoded and measured; what does not, with the reason) of the arrivals."""
    from hpcscale.xsite.outer import (  # lazy: loads torch, kept off `hpcscale sync`
        check_finite,
        contribution_bound,
        decode,
        l2_norm,
    )

    shapes = {k: tuple(v.shape) for k, v in base.theta.items()}
    bound = contribution_bound(shapes)
    valid: list[Checked] = []
    rejected: list[RejectedContribution] = []
    digests: dict[int, str] = {}
    for a in arrived:
        try:
            c = read_contribution(a.path, keyring=keyring, known_sites={s.name for s in cfg.sites},
                                  expected_base_round=r - 1, oldest_base_round=oldest, max_bytes=bound)  # fmt: skip
            if c.site != a.site.name:
                raise Rejected(f"signed as {c.site} but pushed to {a.site.name}'s incoming directory")
            _bound_to(cfg, c, base, digests, keyring)
            tensors = decode(c.tensors, c.encoding, shapes)
            problem = check_finite(tensors)
            if problem:
                raise Rejected(problem)
            valid.append(Checked(c, tensors, l2_norm(tensors)))
        except (Rejected, BadInput) as e:  # BadInput: decode's refusal of a payload that does not fit the model
            reason = e.reason if isinstance(e, Rejected) else str(e)
            rejected.append(RejectedContribution(site=a.site.name, reason=reason, base_round=a.base))
    return valid, rejected


def _bound_to(cfg: XsiteConfig, c, base, digests: dict[int, str], keyring) -> None:
    """Rejected unless contribution `c` names this training and was computed against the very θ(base) it
    names (a training that names itself: from its round 0 on; one whose rounds name none, from before records
    did, takes unbound contributions). digests caches each base round's θ digest for this tick."""

    if base.training is None:
        return
    if c.training is None:
        raise Rejected(
            f"names no training or base weights (written by an hpcscale older than {base.training}'s rounds): "
            "upgrade that site"
        )
    if c.training != base.training:
        raise Rejected(f"from another cross-site training ({c.training}); this one is {base.training}")
    b = c.base_round
    if b not in digests:
        older = None if b == base.round else _verified_round(cfg, _state(cfg.site(cfg.aggregator)), keyring, b,
                                                              where=ROUNDS)  # fmt: skip
        if b != base.round and older is None:
            raise Rejected(f"its base round {b} is no longer kept here: it cannot be checked, so it is not applied")
        digests[b] = theta_digest(base.theta if older is None else older.theta)
    if c.base_theta_sha256 != digests[b]:
        raise Rejected(f"computed against other weights than round {b}'s (θ digest {c.base_theta_sha256[:16]}…)")


def _foreign(cfg: XsiteConfig, state: Path, published) -> str | None:
    """Why a verified round must not be used by this site (None: it may): it names another training than the
    one this site follows (state/TRAINING, recorded at the first round handed over), or, before that, another
    config's name; or it names none while this site follows one."""
    known = None
    if os.path.lexists(state / TRAINING):  # unreadable (a FIFO, a device, not text): BadInput, the tick stops
        data = read_bounded(state / TRAINING, max_bytes=4096, what="record of the training this site follows")
        try:
            known = data.decode("ascii").strip()
        except UnicodeDecodeError:
            raise BadInput(f"{state / TRAINING}: not a training's name (delete it only to start again)") from None
    if published.training is None:
        return None if known is None else f"names no training, and this site follows {known}"
    if known is None:
        if published.training.rsplit(":", 1)[0] != cfg.name:
            return f"from cross-site training {published.training}, not one of {cfg.name!r}"
        return None
    if published.training != known:
        return f"from another cross-site training ({published.training}); this site follows {known}"
    return None


def _report_rejections(state: Path, r: int, rejected: list, report: TickReport) -> list:
    """Each rejection reported once (every tick re-reads the incoming files); returns the ones new now."""
    seen = _read_json(state / REJECTED)
    fresh = [x for x in rejected if seen.get(f"{r}/{x.site}") != x.reason]
    for x in fresh:
        seen[f"{r}/{x.site}"] = x.reason
        report.add("rejected", round=r, site=x.site, reason=x.reason)
    if fresh:
        atomic_write(state / REJECTED, json.dumps(seen).encode())
    return fresh


def _quorum(cfg: XsiteConfig, state: Path, r: int, on_time: list[str], clock: TickClock) -> tuple[bool, float]:
    """(whether round r is applied now, seconds waited since its first on-time contribution)."""
    quorum = _read_json(state / QUORUM)
    stamp = quorum.get(str(r))
    waited = clock.waited(stamp) if stamp is not None else None
    if on_time and waited is None:  # the first contribution, or a start the clock put in the future: from now
        quorum[str(r)] = clock.stamp()
        atomic_write(state / QUORUM, json.dumps(quorum).encode())
        waited = 0.0
    waited = waited or 0.0
    ready = len(on_time) >= cfg.quorum.min_sites or (bool(on_time) and waited >= cfg.quorum.timeout_seconds)
    return ready, waited


def _screen(cfg: XsiteConfig, state: Path, r: int, base, valid: list[Checked]):
    """outer.screen over these contributions: refused (no honest round could have their norm), held out or cut
    to the usual size, each against the other sites' norms applied in the last HISTORY_ROUNDS published rounds."""
    from hpcscale.xsite.outer import HISTORY_ROUNDS, l2_norm, screen  # lazy: loads torch, kept off `hpcscale sync`

    return screen(
        {c.site: c.norm for c in valid},
        theta_norm=l2_norm(base.theta),
        history=_applied_norms(cfg, state, range(max(1, r - HISTORY_ROUNDS), r)),
        aggregator=cfg.aggregator,
        alone=len(cfg.sites) == 1,
        factor=cfg.outer.outlier_factor,
        max_delta_ratio=cfg.outer.max_delta_ratio,
    )


def _applied_norms(cfg: XsiteConfig, state: Path, rounds: range) -> dict[str, list[float]]:
    """site -> the norms its contributions were applied with in these published rounds (this aggregator's own
    records; a round missing, unreadable or without norms adds nothing). Only this config's sites, and only
    finite numbers from 0 to fp32's largest: whatever the file says, a norm that could not be a Δ's is left out."""

    sites = {s.name for s in cfg.sites}
    out: dict[str, list[float]] = {}
    for past in rounds:
        doc = _read_json(state / ROUNDS / f"{round_stem(past)}.json")
        for a in doc.get("accepted", []) if isinstance(doc.get("accepted"), list) else []:
            if not isinstance(a, dict) or not isinstance(a.get("site"), str) or a["site"] not in sites:
                continue
            norm = a.get("norm")
            if isinstance(norm, int | float) and not isinstance(norm, bool) and 0 <= norm <= FP32_MAX:
                out.setdefault(a["site"], []).append(float(norm))  # NaN fails the comparison above
    return out


def _combine(cfg: XsiteConfig, valid: list[Checked]) -> dict[str, torch.Tensor]:
    """Δ̄ by the configured rule; token weights (the `mean` rule's) capped relative to the other sites'."""
    from hpcscale.xsite.outer import aggregate, capped_weights  # lazy: loads torch, kept off `hpcscale sync`

    if cfg.outer.rule == "mean" and cfg.weighting == "tokens":
        weights = capped_weights({c.site: c.contribution.tokens for c in valid}, ratio=cfg.outer.max_weight_ratio)
    else:
        weights = {c.site: 1.0 for c in valid}
    return aggregate([(weights[c.site], c.tensors) for c in valid], rule=cfg.outer.rule, trim=cfg.outer.trim)


def _decided(state: Path, rounds: range) -> set[tuple[str, int]]:
    """(site, base round) of every contribution the given published rounds applied or refused: a refused one
    (a norm outlier, a bad signature) must not come back as a late contribution in a later round. An entry
    without base_round (written before late folding existed) was for its round's parent."""
    out = set()
    for r in rounds:
        doc = _read_json(state / ROUNDS / f"{round_stem(r)}.json")
        for key in ("accepted", "rejected"):
            for a in doc.get(key, []) if isinstance(doc.get(key), list) else []:
                if isinstance(a, dict) and isinstance(a.get("site"), str):
                    b = a.get("base_round", r - 1)
                    out.add((a["site"], b if type(b) is int else r - 1))
    return out


STATE_JSON_MAX = 16 << 20  # quorum.json, rejected.json, a round's record: bounded (pruned to keep_rounds)


def _read_json(path: Path) -> dict:
    """A JSON object this tick keeps (its own records, which others may have written over): {} for anything
    else, read bounded and never from a FIFO or a device."""
    try:
        doc = json.loads(read_bounded(path, max_bytes=STATE_JSON_MAX, what="record"))
        return doc if isinstance(doc, dict) else {}
    except (BadInput, ValueError, RecursionError):
        return {}


# ---- 5. push rounds; 6. hand over ---------------------------------------------------------------------------------
def _site_copy(cfg: XsiteConfig, state: Path, key, keyring, r: int) -> Path:
    """outgoing/round-r: the published round's θ, signed again without the momentum (a site needs only θ, and
    the downlink to every site is most of a round's bytes). Made from the verified full round, so a tick killed
    between publishing and this is completed by the next."""

    path = state / OUTGOING / f"{round_stem(r)}.json"
    if path.exists():
        return path
    full = _verified_round(cfg, state, keyring, r, where=ROUNDS)
    from dataclasses import replace

    return write_round(
        state / OUTGOING,
        round=r,
        parent=full.parent,
        outer=full.outer,
        # without the norms (the aggregator's own history): a site still on a release that does not know the
        # field would refuse the whole round
        accepted=[replace(a, norm=None) for a in full.accepted],
        training=full.training,
        rejected=full.rejected,
        theta=full.theta,
        momentum=None,
        key=key,
        compression=cfg.compression,
    )


def _push_round(
    cfg: XsiteConfig, me: XsiteSite, site: XsiteSite, key, keyring, report: TickReport, clock: TickClock
) -> None:
    state = _state(me)
    published = _published(state)
    if not published:
        return
    r = published[-1]
    newest = _site_copy(cfg, state, key, keyring, r)
    outgoing = newest.parent
    marker = outgoing / f".pushed-{site.name}-{newest.stem}"
    # answered: the site contributed from round r (or later), so it has it
    incoming = state / INCOMING / site.name
    answered = incoming.is_dir() and any(
        (m := _CONTRIB.match(p.name)) and m.group("site") == site.name and int(m.group("base")) >= r
        for p in incoming.glob("contrib-*.json")
    )
    why = _unanswered(marker, answered, cfg, clock)
    if why is None:
        return
    n = _push(cfg, _pair(newest), outgoing, _endpoint(site, me, INBOX))
    _fault("round_pushed")
    atomic_write(marker, json.dumps({"bytes": n, "at": clock.wall}).encode())  # replaces a planted link
    again = {} if why == "not pushed yet" else {"again": why}
    report.add("pushed", file=newest.name, to=site.name, bytes=n, **again)


def _hand_over(cfg: XsiteConfig, me: XsiteSite, keyring, report: TickReport) -> None:
    state = _state(me)
    found = _rounds_in(state / INBOX)
    if not found:
        return
    run = _run(me)
    if not (run / "job.yaml").is_file():  # the job has not been started (its run directory is not made yet)
        report.add("waiting", reason=f"round {found[-1]} is here; {run} is not a run directory yet")
        return
    try:  # the tick's own record, never the names in RUN/xsite
        newest_handed = latest_global(run)
    except handed.RecordError as e:  # nothing is handed over into a directory or over a record it cannot trust
        report.error_once("hand over", str(e))
        return
    for r in reversed(found):  # the newest round that verifies: a stray or forged name must not block the rest
        if newest_handed is not None and r <= newest_handed:
            return
        refused = state / INBOX / f".refused-{round_stem(r)}"
        if refused.exists():  # refused at an earlier tick: not verified (nor reported) again
            continue
        try:
            published = _verified_round(cfg, state, keyring, r)
            problem = _foreign(cfg, state, published) or _unfit_round(run, published)
            if problem:
                raise Rejected(problem)
        except Rejected as e:
            atomic_write(refused, e.reason.encode())
            report.add("rejected", file=f"{INBOX}/{round_stem(r)}.json", reason=e.reason)
            continue
        try:
            _write_global(run, r, published, report)
        except handed.RecordError as e:
            report.error_once("hand over", str(e))
            return
        if published.training and not (state / TRAINING).is_file():  # the training this site follows from now on
            atomic_write(state / TRAINING, published.training.encode())
        return


def _unfit_round(run: Path, published) -> str | None:
    """Why a verified round must not be handed to the run (None: it may): θ not finite or beyond the bound a
    published round keeps (outer.check_outer_result), or names and shapes other than the run's model's (its
    newest checkpoint's, where it has one). A site that refuses a round goes on to the next valid one."""
    from hpcscale.ckpt.format import (  # lazy: loads numpy, which this module avoids
        INDEX,
        committed_steps,
        read_index,
        step_dir_name,
    )
    from hpcscale.xsite.outer import check_outer_result  # lazy: loads torch, kept off `hpcscale sync`

    problem = check_outer_result(published.theta, {})
    if problem:
        return problem
    root = run / "checkpoints"
    try:
        steps = committed_steps(root)
        index = read_index(root / step_dir_name(steps[0]) / INDEX) if steps else None
    except Exception:  # an unreadable checkpoint says nothing about the round: the trainer checks again
        index = None
    if index is None:
        return None
    model = {
        n.removeprefix("model/"): tuple(rec.global_shape) for n, rec in index.tensors.items() if n.startswith("model/")
    }
    got = {k: tuple(v.shape) for k, v in published.theta.items()}
    common = model.keys() & got.keys()
    # names may differ a little (persistent buffers of another library version); another model's would not
    if len(common) * 2 < len(got):
        return f"its tensors are not this run's model's ({len(common)} of its {len(got)} names are the model's)"
    wrong = sorted(k for k in common if model[k] != got[k])
    return f"{wrong[0]} has shape {got[wrong[0]]}, this run's model has {model[wrong[0]]}" if wrong else None


def _write_global(run: Path, r: int, published, report: TickReport) -> None:
    from safetensors.torch import save

    data = save({k: v.contiguous() for k, v in published.theta.items()}, metadata={"round": str(r)})
    _fault("handed")
    # RUN/xsite made (or checked) as the user's alone; θ whole or not at all, then the record naming it with its
    # digest: a full disk (or a SIGKILL) never leaves a torn θ, nor a record naming one, where the trainer looks
    handed.write(run, r, data)
    report.add("handed over", round=r, run=str(run))


# ---- 7. retention ----------------------------------------------------------------------------------------------
_NUMBERED = re.compile(r"(?:^|-)r(?:ound-)?(\d{6})(?:\.|$)")  # round-000004.json, contrib-a-r000004.json, global-r…


def _round_of(name: str) -> int | None:
    """The round a file belongs to: round-R and global-rR are round R; contrib-S-rB (Δ against base B) is for
    round B + 1. The last number on the name counts: a site name may look like one."""
    found = _NUMBERED.findall(name)
    if not found:
        return None
    return int(found[-1]) + (1 if name.startswith("contrib-") else 0)


def _prune(cfg: XsiteConfig, me: XsiteSite, report: TickReport) -> None:
    """Delete rounds older than the newest keep_rounds (and contributions for them, and their push markers).
    The newest round a site knows is never deleted, nor anything a later step of a tick still needs."""
    state = _state(me)
    oldest = _oldest_kept(cfg, _verified_rounds(cfg, me, report))
    if oldest == 0:
        return
    dirs = [(state, (INBOX,)), (state, (OUTBOX,))]
    if me.name == cfg.aggregator:
        dirs += [(state, (ROUNDS,)), (state, (OUTGOING,))] + [(state, (INCOMING, s.name)) for s in cfg.sites]
    removed = records = 0
    try:  # the record first, then the files (handed.prune)
        removed += handed.prune(_run(me), oldest)
    except handed.RecordError as e:
        report.error_once("hand over", str(e))
    for base, parts in dirs:
        removed += _prune_dir(base, parts, lambda name: (r := _round_of(_unmarked(name))) is not None and r < oldest)
    if me.name == cfg.aggregator:  # the aggregator's per-round records: quorum times, rejections reported
        for name in (QUORUM, REJECTED):
            record = _read_json(state / name)
            kept = {k: v for k, v in record.items() if (_record_round(k) or 0) >= oldest}
            if len(kept) != len(record):
                atomic_write(state / name, json.dumps(kept).encode())
                records += len(record) - len(kept)
    if removed or records:
        report.add("pruned", before_round=oldest, files=removed, records=records)


def _unmarked(name: str) -> str:
    """A record's name under its marker's (.pushed-, .skipped-, .refused-): the round it is about."""
    for prefix in (".pushed-", ".skipped-", ".refused-"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _prune_dir(base: Path, parts: tuple[str, ...], old: Callable[[str], bool]) -> int:
    """Unlink the regular files `old(name)` picks in base/parts..., never following a symlink below `base`: a
    partner that can write its incoming/ directory may swap it for a link to anywhere, and retention must not
    delete there (every component is opened relative to its parent with O_NOFOLLOW; files are unlinked by name
    in that directory). A component that is missing, or not a directory, has nothing to prune."""
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(base, os.O_RDONLY | os.O_DIRECTORY))
            for part in parts:
                fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
        except OSError:  # missing, a symlink (ELOOP), not a directory: nothing of ours to prune there
            return 0
        removed = 0
        for name in os.listdir(fds[-1]):
            if not old(name):
                continue
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(name, dir_fd=fds[-1]).st_mode):
                    os.unlink(name, dir_fd=fds[-1])
                    removed += 1
        return removed
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _pending(cfg: XsiteConfig, me: XsiteSite, state: Path) -> dict[str, Any]:
    """(aggregator) the round being built and what holds it: round 0 without a start checkpoint to publish it
    from, or the next round's wait, its refused contributions and a result that was not published."""
    published = _published(state)
    r = published[-1] + 1 if published else 0
    out: dict[str, Any] = {"round": r, "blocked": None, "behind": None, "waiting_since": None, "rejected": {}}
    out["behind"] = _read_json(state / REJECTED).get(f"{r}/{BEHIND}")
    if r == 0:
        starts = [s for s, tag in _round_checkpoints(_run(me)) if tag["base_round"] == -1 and s == _start(tag)]
        if not starts:
            out["blocked"] = (
                f"round 0 is published from the aggregator's start checkpoint (a checkpoint of {_run(me)} tagged "
                "xsite.base_round -1 at the rounds' start step), and there is none: its job has not saved it yet, "
                "or it was deleted. Start (or restart) the aggregator site's job: it saves the start checkpoint first"
            )
        return out
    stamp = _read_json(state / QUORUM).get(str(r))
    wall = stamp.get("wall") if isinstance(stamp, dict) else stamp
    out["waiting_since"] = wall if isinstance(wall, int | float) and not isinstance(wall, bool) else None
    for key, reason in _read_json(state / REJECTED).items():
        head, _, site = key.partition("/")
        if head == str(r) and site == "!outer":
            out["blocked"] = f"the outer step's result was not published: {reason}"
        elif head == str(r) and site != BEHIND:
            out["rejected"][site] = reason
    return out


def _record_round(key: str) -> int | None:
    """The round of a quorum.json key ("7") or a rejected.json key ("7/site")."""
    head = key.partition("/")[0]
    return int(head) if head.isdigit() else None


# ---- status ------------------------------------------------------------------------------------------------------
def status(cfg: XsiteConfig, site_name: str) -> dict[str, Any]:
    """This site's view: its log's rounds × sites, what is in its outbox, inbox and (aggregator) rounds."""
    me = cfg.site(site_name)
    if me is None:
        raise BadInput(f"--site {site_name}: not a site of {cfg.name}")
    state = _state(me)
    events = []
    with contextlib.suppress(BadInput):  # the newest LOG_MAX_BYTES, of a regular file; lines that are objects
        tail = read_tail(state / LOG, max_bytes=LOG_MAX_BYTES, what="sync log", missing_ok=True)
        for line in tail.data.splitlines() if tail else ():
            with contextlib.suppress(ValueError, RecursionError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.append(event)
    pushed = [e for e in events if e.get("event") == "pushed" and isinstance(e.get("bytes"), int)]
    sent = sum(e["bytes"] for e in pushed)
    egress: dict[tuple[int, str], int] = {}  # (round, destination) -> bytes this site sent for it
    for e in pushed:
        if e.get("to") == me.name:  # the aggregator's copy to its own directories: no link crossed
            continue
        r = _round_of(str(e.get("file", "")))
        if r is not None:
            key = (r, str(e.get("to")))
            egress[key] = egress.get(key, 0) + e["bytes"]
    received = sum(p.stat().st_size for p in (state / INBOX).glob("round-*") if p.is_file())
    if me.name == cfg.aggregator:
        received += sum(p.stat().st_size for p in (state / INCOMING).glob("*/contrib-*") if p.is_file())
    waited = {
        e["round"]: e.get("waited_s") for e in events if e.get("event") == "published" and type(e.get("round")) is int
    }
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
        "pending": _pending(cfg, me, state) if me.name == cfg.aggregator else None,
        "contributions": sorted(p.name for p in (state / OUTBOX).glob("contrib-*.json")),
        "inbox": sorted(p.name for p in (state / INBOX).glob("round-*.json")),
        "rounds": [rounds[r] for r in sorted(rounds)],
        "bytes_sent": sent,
        "bytes_received": received,
        "egress": [{"round": r, "to": to, "bytes": n} for (r, to), n in sorted(egress.items())],
        "errors": [e for e in events if e.get("event") == "error"][-10:],
        "last_tick": events[-1].get("time") if events else None,
    }

"""Cross-site config: the sites of one cross-site training, who aggregates, and the round's rules.

One file, the same on every site (docs/cross-site.md). Each site's `hpcscale sync --config X --site S` tick
reads it; so does the trainer of a job whose spec names it (`xsite: {config: X, site: S}`), for the round
length and how long to wait for the next global weights. Reference: docs/config-reference.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpcscale.config.decode import Decoder
from hpcscale.config.errors import ConfigError
from hpcscale.config.fields import setting
from hpcscale.config.site import check_name
from hpcscale.config.yamlsrc import YamlSource, load_yaml

_ENDPOINT = re.compile(r"^(ssh://[^\s]+|/[^\s]*)$")


def check_endpoint(value: str) -> str | None:
    if not _ENDPOINT.match(value) or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
        return f"{value!r} is neither an absolute path nor ssh://[user@]host[:port]/path"
    if value.startswith("ssh://"):
        # the host and user reach ssh's command line: one that begins with '-' would be read as an option
        user, _, host = value[6:].partition("/")[0].rpartition("@")
        for name, part in (("host", host), ("user", user)):
            if part.startswith("-"):
                return f"'{value}': the ssh {name} '{part}' begins with '-' (ssh would take it for an option)"
    return None


def check_abs(value: str) -> str | None:
    if not (value.startswith("/") or value.startswith("~")):
        return f"'{value}' is not an absolute path (or ~/...)"
    return None


@dataclass(kw_only=True, slots=True)
class XsiteSite:
    """One site: where its run and its sync state live, and how the other sites reach it."""

    name: str = setting("The site's name in contributions, signatures and `sync --site`.", check=check_name)
    run: str = setting(
        "The run directory of this site's training job (on this site): its round checkpoints are read, the "
        "global weights handed to it.",
        check=check_abs,
    )
    state: str = setting(
        "This site's sync state directory (on this site): outbox, inbox, the tick lock and log; on the "
        "aggregator also every site's incoming contributions and the published rounds.",
        check=check_abs,
    )
    reach: str = setting(
        "How the other sites reach this site's `state` directory: `ssh://[user@]host[:port]/path` (or a path "
        "on a filesystem both share). The aggregator pushes rounds to `<reach>/inbox`; sites push their "
        "contributions to the aggregator's `<reach>/incoming/<site>`.",
        check=check_endpoint,
    )
    key: str = setting("This site's ed25519 private key (on this site; `hpcscale sync keygen`).", check=check_abs)


@dataclass(kw_only=True, slots=True)
class Outer:
    """The outer step the aggregator applies to the averaged contribution (DiLoCo: Nesterov SGD)."""

    lr: float = setting("Outer learning rate η (1.0 with momentum 0: federated averaging).", default=0.7, min=0)
    momentum: float = setting("Outer Nesterov momentum μ.", default=0.9, min=0, max=0.999)
    rule: Literal["auto", "mean", "median", "trimmed_mean"] = setting(
        "How contributions are combined. `auto`: as robust as the number of sites allows (1: as it is; 2: equal "
        "mean with each Δ clipped to the smaller norm; 3 or more: coordinate-wise median), weights ignored. "
        "`mean`: weighted mean (not robust: docs/cross-site.md's threat model). `median`, `trimmed_mean`: "
        "coordinate-wise, weights ignored.",
        default="auto",
    )
    trim: float = setting("trimmed_mean: the share cut at each end.", default=0.2, min=0, max=0.49)
    outlier_factor: float = setting(
        "Refuse a contribution whose norm exceeds this many times the median of the others' in its round (3 "
        "contributions or more). One above this many times the other sites' recent norms (never its own: the "
        "median over the other sites of each one's median norm applied in the last 5 rounds) is cut down to it "
        "when 2 or more other sites make that reference, held out of the round when one does (with two sites: "
        "the aggregator's own site's contribution is kept).",
        default=10.0,
        min=1,
    )
    max_delta_ratio: float = setting(
        "Reject a contribution whose norm exceeds this many times max(‖θ(base)‖, 1): no round of inner steps "
        "moves the weights that far (the bound that holds whatever else is known, or not yet).",
        default=100.0,
        min=1,
    )
    max_weight_ratio: float = setting(
        "`mean` with `weighting: tokens`: a site's weight is at most this many times the median of the other "
        "sites' token counts (a token count is the site's own claim).",
        default=2.0,
        min=1,
    )


@dataclass(kw_only=True, slots=True)
class Quorum:
    """When the aggregator applies a round."""

    min_sites: int = setting(
        "Contributions needed before the timeout; at the timeout any number ≥ 1.", default=2, min=1
    )
    timeout_seconds: float = setting(
        "From the first contribution of a round: after this, aggregate what is in (at least one).",
        default=1800,
        min=0,
    )
    late_rounds: int = setting(
        "Fold a late contribution into a later round: one whose base round is at most this many rounds older "
        "than the round being built's, from a site with nothing newer, not applied before (a stale Δ, as in "
        "asynchronous SGD). 0: a contribution that misses its round is ignored.",
        default=0,
        min=0,
        max=8,
    )


@dataclass(kw_only=True, slots=True)
class XsiteConfig:
    """A cross-site training: the sites, the aggregator, the round."""

    name: str = setting("Name of the cross-site training (logs, status).", check=check_name)
    sites: list[XsiteSite] = setting("Every site taking part.", factory=list)
    aggregator: str = setting("The site that aggregates and publishes rounds.", check=check_name)
    round_steps: int = setting("H: inner steps each site takes per round.", min=1)
    encoding: Literal["fp32", "bf16", "int8"] = setting(
        "How a contribution travels: `fp32` (exact), `bf16` (half the bytes), `int8` (a quarter; per-chunk "
        "binning over mean ± 6σ).",
        default="fp32",
    )
    compression: Literal["zstd", "none"] = setting(
        "How the records that travel (contributions, the sites' copies of each round) store their tensors: "
        "`zstd` (lossless: a little smaller, for CPU time at both ends: a saving in time on slow links, a cost "
        "on fast ones and on a shared filesystem; the figures are in docs/benchmarks.md) or `none`. Readers take "
        "either. An hpcscale older than compressed records refuses them, and this key: set `none` on the upgraded "
        "sites while another is not upgraded yet (docs/cross-site.md, runbook).",
        default="zstd",
    )
    weighting: Literal["tokens", "equal"] = setting(
        "Weights of the mean: tokens each site saw in the round, or equal.", default="tokens"
    )
    outer: Outer = setting("The outer optimizer.", factory=Outer)
    quorum: Quorum = setting("When a round is applied.", factory=Quorum)
    wait_seconds: float = setting(
        "How long a trainer waits at a round boundary for the new global weights before training on locally "
        "(it adopts them at a later boundary).",
        default=600,
        min=0,
    )
    adopt: Literal["wait", "overlap"] = setting(
        "What a trainer does at a round boundary: `wait` for the new global weights (up to wait_seconds) and "
        "adopt them before the next step; or `overlap`: keep training and adopt them when they land, keeping "
        "the local progress made meanwhile (θ ← θ(r) + (θ_now − θ_boundary)); the exchange then hides behind "
        "compute, at most one round late (at the next boundary it waits).",
        default="wait",
    )
    keep_rounds: int = setting(
        "How many of the newest rounds each site keeps (published rounds and their site copies on the "
        "aggregator, the inbox, contributions, the global weights handed to the run); older ones are deleted "
        "by the tick. A site whose newest round checkpoint starts from a round no longer kept cannot contribute "
        "it: it adopts the newest round instead.",
        default=10,
        min=2,
    )
    keys: str = setting("Directory of every site's public key (`<site>.pub`), the same on every site.", check=check_abs)
    ssh: list[str] = setting(
        "The ssh command and options a tick reaches other sites with (the staging ssh transport), e.g. "
        "`[ssh, -i, ~/.ssh/xsite, -o, BatchMode=yes]`.",
        factory=lambda: ["ssh"],
    )

    def site(self, name: str) -> XsiteSite | None:
        return next((s for s in self.sites if s.name == name), None)


def parse_xsite(src: YamlSource) -> XsiteConfig:
    dec = Decoder(src)
    cfg = dec.decode(XsiteConfig, src.data)
    dec.raise_if_any()
    names = [s.name for s in cfg.sites]
    if len(names) < 1:
        dec.error(("sites",), "lists no site")
    for i, name in enumerate(names):
        if name in names[:i]:
            dec.error(("sites", i, "name"), f"site '{name}' is listed twice")
    if names and cfg.aggregator not in names:
        dec.error(("aggregator",), f"'{cfg.aggregator}' is not one of the sites ({', '.join(names)})")
    if cfg.quorum.min_sites > len(names):
        dec.error(("quorum", "min_sites"), f"{cfg.quorum.min_sites} is more than the {len(names)} site(s)")
    if cfg.keep_rounds < cfg.quorum.late_rounds + 2:  # a late contribution's base round must still be kept
        need = cfg.quorum.late_rounds + 2
        dec.error(
            ("keep_rounds",),
            f"{cfg.keep_rounds} keeps fewer rounds than quorum.late_rounds + 2 ({need}): a late contribution "
            "would be deleted before it is folded",
        )
    dec.raise_if_any()
    return cfg


def load_xsite(path: str | Path) -> XsiteConfig:
    return parse_xsite(load_yaml(Path(path)))


__all__ = ["ConfigError", "XsiteConfig", "XsiteSite", "load_xsite", "parse_xsite"]

"""Cross-site tests without trainers: sites on this machine (state and run directories under a tmp dir, each
reached by its local path), their keys, and round 0 published by the aggregator. The ticks are the product's."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from hpcscale.config.xsite import XsiteConfig, load_xsite
from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import rounds
from hpcscale.xsite.outer import encode
from hpcscale.xsite.signing import generate_key, load_private


def sites_with_round0(
    tmp: Path,
    sites: tuple[str, ...],
    theta0: dict[str, torch.Tensor],
    *,
    name: str,
    quorum: dict,
    outer: dict,
    bound: bool = False,
) -> tuple[XsiteConfig, Path]:
    """(the config, the keys directory) of `sites`, the first the aggregator, with round 0 = theta0 published.
    bound: round 0 names its training, as the tick's own round 0 does (every later record is then bound to it)."""
    keys = tmp / "keys"
    keys.mkdir()
    for s in sites:
        generate_key(keys, s)
    cfg = {
        "name": name,
        "aggregator": sites[0],
        "round_steps": 10,
        "keys": str(keys),
        "quorum": quorum,
        "outer": outer,
        "sites": [
            {
                "name": s,
                "run": str(tmp / f"run-{s}"),
                "state": str(tmp / f"state-{s}"),
                "reach": str(tmp / f"state-{s}"),
                "key": str(keys / f"{s}.key"),
            }
            for s in sites
        ],
    }
    path = tmp / "xsite.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_xsite(path)
    published = tmp / f"state-{sites[0]}" / rounds.ROUNDS
    published.mkdir(parents=True)
    rf.write_round(published, round=0, parent=None, outer=rounds._outer(config), accepted=[], rejected=[],
                   theta=theta0, momentum={k: torch.zeros_like(v) for k, v in theta0.items()},
                   key=load_private(keys / f"{sites[0]}.key"),
                   training=rf.training_id(name, theta0) if bound else None)  # fmt: skip
    return config, keys


def contribute_delta(state: Path, keys: Path, *, site: str, base: int, theta: dict, seed: int, training: str,
                     shapes: dict) -> None:  # fmt: skip
    """What `site`'s export writes into its outbox in `state`: a seeded Δ against θ(base) `theta`, bound to it."""
    g = torch.Generator().manual_seed(seed)
    delta = {k: torch.randn(*shape, generator=g) * 0.05 for k, shape in shapes.items()}
    outbox = state / rounds.OUTBOX
    outbox.mkdir(parents=True, exist_ok=True)
    rf.write_contribution(outbox, site=site, base_round=base, steps=10, tokens=1000, encoding="fp32",
                          tensors=encode(delta, "fp32"), key=load_private(keys / f"{site}.key"),
                          training=training, base_theta_sha256=rf.theta_digest(theta))  # fmt: skip

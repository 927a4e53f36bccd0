"""Job specs and metrics for the training and checkpoint tests: one tiny GPT, every layout."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

PARAMS = {
    "steps": 20,
    "log_every": 100,
    "eval_every": 0,
    "global_batch": 8,
    "micro_batch": 2,
    "seq_len": 32,
    "n_layer": 4,
    "n_embd": 32,
    "n_head": 4,
    "seed": 7,
}


def job_spec(
    path: Path,
    *,
    tp: int,
    pp: int,
    ranks: int,
    site: str = "local",
    nodes: int = 1,
    checkpoint: dict | None = None,
    dp_shard: int = 1,
    parallel: dict | None = None,
    **params,
) -> Path:
    """A job running the reference trainer with PARAMS (overridden by `params`) at the given layout."""
    spec = {
        "name": f"tiny-tp{tp}-pp{pp}",
        "site": site,
        "nodes": nodes,
        "tasks_per_node": ranks // nodes,
        "parallel": {"tp": tp, "pp": pp, **({"dp_shard": dp_shard} if dp_shard > 1 else {}), **(parallel or {})},
        "timeout_seconds": 60,
        "train": {"entry": "builtin", "params": {**PARAMS, **params}},
    }
    if checkpoint is not None:
        spec["checkpoint"] = checkpoint
    path.write_text(yaml.safe_dump(spec))
    return path


def losses(run: Path) -> dict[int, float]:
    """step -> training loss, from RUN/metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def grad_norms(run: Path) -> list[float]:
    """Each step's global gradient norm before clipping, from RUN/metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]

"""Job specs and metrics for the training and checkpoint tests: one tiny GPT, every layout."""

from __future__ import annotations

import json
import os
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


# What a GPU cluster runs by default, on CPU ranks: fused AdamW, bf16 mixed precision, async saves (and, for a
# user's model, foreach AdamW: torch's default on CUDA). HPCSCALE_TEST_GPU_DEFAULTS=1 turns it on for every job
# this module makes; tests/training/test_gpu_defaults.py always runs it.
GPU_DEFAULTS = {
    "params": {"fused_optimizer": True},
    "parallel": {"mixed_precision": "bf16"},
    "checkpoint": {"async": True},
    "user_params": {"optimizer": "foreach"},
}


def gpu_defaults_on() -> bool:
    return os.environ.get("HPCSCALE_TEST_GPU_DEFAULTS", "") == "1"


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
    gpu_defaults: bool | None = None,
    **params,
) -> Path:
    """A job running the reference trainer with PARAMS (overridden by `params`) at the given layout; with
    `gpu_defaults` (default: HPCSCALE_TEST_GPU_DEFAULTS) the GPU_DEFAULTS settings under any given here."""
    if gpu_defaults if gpu_defaults is not None else gpu_defaults_on():
        params = {**GPU_DEFAULTS["params"], **params}
        parallel = {**GPU_DEFAULTS["parallel"], **(parallel or {})}
        checkpoint = {**GPU_DEFAULTS["checkpoint"], **(checkpoint or {})}
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


def metric_rows(run: Path) -> list[dict]:
    """RUN/metrics.jsonl's rows, parsed."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> dict[int, float]:
    """step -> training loss, from RUN/metrics.jsonl."""
    rows = metric_rows(run)
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def attempt_losses(run: Path, attempt: int) -> dict[int, float]:
    """step -> training loss as attempt ATTEMPT logged it (a resumed run's steps trained again are in both)."""
    rows = metric_rows(run)
    return {r["step"]: r["loss"] for r in rows if "loss" in r and r.get("attempt") == attempt}


def grad_norms(run: Path) -> list[float]:
    """Each step's global gradient norm before clipping, from RUN/metrics.jsonl."""
    rows = metric_rows(run)
    return [r["grad_norm"] for r in rows if "grad_norm" in r]

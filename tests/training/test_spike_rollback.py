"""Loss spikes injected into the data (docs/observability.md#spikes): with `train.on_spike: warn` each is named
with its step and data position; with `rollback` the run goes back to the newest checkpoint, skips the data
read since it up to the spike's batch, records it (metrics.jsonl, the checkpoints' state), and then trains
exactly as a run that never saw those batches. The second spike comes right after the first rollback, before
any new save: the run goes back to the same checkpoint and must skip past both spikes' batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import PARAMS

from hpcscale.data.loader import TokenLoader

SEQ = PARAMS["seq_len"]
SAMPLE = SEQ + 1  # bytes per sample: one file, so sample i is bytes [i * SAMPLE, (i + 1) * SAMPLE)
BATCH = PARAMS["global_batch"]
BATCHES = 50
STEPS, SPIKE, EVERY = 40, 27, 5  # the spike's batch is read at step SPIKE; the newest checkpoint before it: 25
BACK = SPIKE // EVERY * EVERY
SECOND = SPIKE + 2  # a second spiked batch: read at step BACK + 1 after the first rollback (step 25 reads 28)
RESUMED = SECOND + 1  # the batch the run reads at step BACK after the second rollback


def _text_samples() -> np.ndarray:
    """BATCHES x BATCH samples of ordinary text: hpcscale's own sources, SAMPLE bytes each."""
    text = b"".join(p.read_bytes() for p in sorted((REPO / "hpcscale").rglob("*.py")))
    n = BATCHES * BATCH
    assert len(text) >= n * SAMPLE
    return np.frombuffer(text[: n * SAMPLE], dtype=np.uint8).reshape(n, SAMPLE).copy()


def _prepare(tmp: Path, name: str, samples: np.ndarray) -> Path:
    src = tmp / f"{name}.txt"
    src.write_bytes(samples.tobytes())
    out = tmp / name
    r = run_cli("data", "prepare", str(src), "--out", str(out), "--seq-len", str(SEQ))
    assert r.returncode == 0, r.stderr
    return out / "manifest.json"


def _batch_rows(manifest: Path, k: int) -> np.ndarray:
    """The samples of global batch k of epoch 0, in the order the loader reads them (the loader's own order)."""
    loader = TokenLoader(manifest, seq_len=SEQ, global_batch=BATCH, dp_rank=0, dp_size=1, seed=PARAMS["seed"])
    return loader._permutation(0)[k * BATCH : (k + 1) * BATCH]


def _job(tmp: Path, name: str, manifest: Path, on_spike: str) -> Path:
    spec = {
        "name": name,
        "site": "local",
        "nodes": 1,
        "tasks_per_node": 2,
        "timeout_seconds": 60,
        "data": {"manifest": str(manifest)},
        "checkpoint": {"every_steps": EVERY},
        "train": {
            "entry": "builtin",
            "on_spike": on_spike,
            "params": {**PARAMS, "steps": STEPS, "eval_every": 0, "val_fraction": 0.0},
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(rows: list[dict]) -> dict[int, float]:
    """step -> loss, the newest line of each step (a step trained again after a rollback: its second value)."""
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """`spiked`: ordinary text with the batch read at step SPIKE made of bytes 200-255 (text never has them);
    and at SECOND; `without`: the same text where the batches read at steps BACK.. are the spiked set's from RESUMED
    on: what a run that never saw batches BACK..SECOND reads."""
    tmp = tmp_path_factory.mktemp("spike-data")
    samples = _text_samples()
    clean = _prepare(tmp, "order", samples)  # the loader's order: the same for any data of this many samples
    spiked = samples.copy()
    garbage = np.random.default_rng(0)
    for k in (SPIKE, SECOND):
        spiked[_batch_rows(clean, k)] = garbage.integers(200, 256, (BATCH, SAMPLE), dtype=np.uint8)
    without = samples.copy()
    for j in range(STEPS - BACK):
        without[_batch_rows(clean, BACK + j)] = spiked[_batch_rows(clean, RESUMED + j)]
    return {"spiked": _prepare(tmp, "spiked", spiked), "without": _prepare(tmp, "without", without)}


@given(start=st.integers(0, 3 * BATCHES), batches=st.integers(0, 3 * BATCHES))
@settings(max_examples=200, deadline=None)
def test_skipping_batches_leaves_the_loader_where_reading_them_would(datasets, start, batches):
    read = TokenLoader(datasets["spiked"], seq_len=SEQ, global_batch=BATCH, dp_rank=0, dp_size=1, seed=1)
    skipped = TokenLoader(datasets["spiked"], seq_len=SEQ, global_batch=BATCH, dp_rank=0, dp_size=1, seed=1)
    for _ in range(start):
        read.next_batch()
    skipped.load_state_dict(read.state_dict())
    for _ in range(batches):
        read.next_batch()
    skipped.skip(batches)
    assert skipped.state == read.state
    assert all((a == b).all() for a, b in zip(skipped.next_batch(), read.next_batch(), strict=True))


def test_a_spike_is_named_with_its_step_and_data_position(mpi, datasets, tmp_path):
    run = tmp_path / "run"
    out = run_cli("run", str(_job(tmp_path, "warn", datasets["spiked"], "warn")), "--local", "--run-dir", str(run))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run)
    spikes = [r for r in rows if "spike" in r]
    steps = [r["step"] for r in spikes]
    assert steps and steps[0] == SPIKE and SECOND in steps, spikes
    keys = {s["key"] for s in spikes[0]["spike"]}
    assert "loss" in keys, spikes[0]
    assert spikes[0]["position"] == {"loader": {"epoch": 0, "batch": SPIKE + 1, "seed": PARAMS["seed"]}}
    assert f"hpcscale: loss spike at step {SPIKE}:" in out.stdout
    assert not any("rollback" in r for r in rows) and max(_losses(rows)) == STEPS - 1


def test_a_rollback_skips_the_spikes_batches_and_trains_as_a_run_that_never_saw_them(mpi, datasets, tmp_path):
    run, ref = tmp_path / "run", tmp_path / "ref"
    out = run_cli(
        "run", str(_job(tmp_path, "rollback", datasets["spiked"], "rollback")), "--local", "--run-dir", str(run)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run)
    first, second = [r for r in rows if "rollback" in r]
    seed = PARAMS["seed"]
    assert first["step"] == SPIKE and first["rollback"]["to_step"] == BACK
    assert first["rollback"]["from"] == {"loader": {"epoch": 0, "batch": BACK, "seed": seed}}
    assert first["rollback"]["to"] == {"loader": {"epoch": 0, "batch": SPIKE + 1, "seed": seed}}
    assert second["step"] == BACK + 1 and second["rollback"]["to_step"] == BACK  # no save between: the same one
    assert second["rollback"]["to"] == {"loader": {"epoch": 0, "batch": RESUMED, "seed": seed}}
    assert f"hpcscale: rolled back to checkpoint step {BACK}; the data read since it" in out.stdout
    # every step trained once more from BACK on; the spiked step's own update was never kept
    reference = run_cli("run", str(_job(tmp_path, "ref", datasets["without"], "off")), "--local", "--run-dir", str(ref))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert _losses(rows) == _losses(_rows(ref))  # bit for bit, every step
    # the checkpoints written after the rollback carry what it skipped (the older ones are gone: keep_last 3)
    for step in (30, 35, STEPS):
        inspect = run_cli("ckpt", "inspect", str(run / "checkpoints" / f"step-{step:08d}"), "--json")
        assert inspect.returncode == 0, inspect.stderr
        records = json.loads(inspect.stdout)["trainer_state"]["skipped"]
        assert [(r["spike_step"], r["to_step"]) for r in records] == [(SPIKE, BACK), (BACK + 1, BACK)]
        assert [r["to"]["loader"]["batch"] for r in records] == [SPIKE + 1, RESUMED] and records[0]["keys"] == ["loss"]

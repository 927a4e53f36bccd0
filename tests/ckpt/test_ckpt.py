"""Checkpoints: resume bit for bit, reshard across layouts, incremental bytes, crash safety, corruption."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ckpt_job, run_cli
from trainjobs import job_spec
from trainjobs import losses as _losses


def _spec(path: Path, *, tp: int, pp: int, ranks: int, steps: int = 20, keep_last: int = 3) -> Path:
    return job_spec(path, tp=tp, pp=pp, ranks=ranks, steps=steps, checkpoint={"every_steps": 5, "keep_last": keep_last})


def _run(job: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    result = run_cli("run", str(job), "--local", "--run-dir", str(run), *extra, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return result


@pytest.fixture(scope="module")
def uninterrupted(run_2x2x2) -> dict[int, float]:
    """The losses of _spec(tp=2, pp=2, ranks=8) run without a stop: the shared run is that job."""
    return _losses(run_2x2x2)


def test_stop_and_resume_reproduce_the_uninterrupted_run_bit_for_bit(run_pp2_dp2, tmp_path):
    """pp=2, dp=2 (4 ranks): a pipeline's stages and its replicas stop at one step, and the resumed run is the
    uninterrupted one (the shared run of the same job), every step bit for bit."""
    job, run = _spec(tmp_path / "job.yaml", tp=1, pp=2, ranks=4), tmp_path / "run"
    proc = subprocess.Popen(
        ["hpcscale", "run", str(job), "--local", "--run-dir", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and len(_losses(run)) >= 7):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    pids = subprocess.run(["pgrep", "-f", f"hpcscale launch --run-dir {run}"], capture_output=True, text=True).stdout
    ranks = [int(p) for p in pids.split() if Path(f"/proc/{p}/comm").read_text().startswith("python")]
    os.kill(ranks[1], signal.SIGUSR1)  # one rank only (not the first started): the others must follow it
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-2000:]
    assert "stop requested: stopping after step" in out, out[-2000:]
    stopped = len(_losses(run))
    # rank 0 records the stop with the signal rank 1 got (it rides the stop check): rank 0 got none itself
    (event,) = [e for e in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if e["event"] == "stop"]
    assert event["signal"] == "SIGUSR1" and event["step"] + 1 == stopped and event["stop_s"] is None, event
    # rank 0 logged exactly the steps every rank completed, and the stop checkpointed the last of them
    assert stopped == int(out.split("stop requested: stopping after step")[1].split()[0]) + 1
    assert stopped < 20
    resumed = _run(job, run, "--reuse")
    assert f"resumed from checkpoint step {stopped}" in resumed.stdout
    assert _losses(run) == _losses(run_pp2_dp2)  # every step, bit for bit


@pytest.fixture(scope="module")
def saved_at_2_2_2(run_2x2x2, tmp_path_factory) -> Path:
    """A run at tp=2, pp=2, dp=2 (8 ranks) as it stood after step 10, its newest checkpoint at step 10: each
    layout below copies it. The shared 20-step run cut back: its metrics before step 10 and its checkpoints up
    to 10 (all 20 steps are in the learning-rate warmup, so its state at 10 is a 10-step run's)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    shutil.copytree(run_2x2x2, run, symlinks=True)
    assert not (run / "checkpoints").is_symlink()
    for step in (15, 20):
        shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    (run / "checkpoints" / "LATEST").write_text("step-00000010\n")
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(r for r in rows if json.loads(r).get("step", 0) < 10))
    return run


@pytest.mark.parametrize(("tp", "pp", "ranks"), [(1, 1, 1), (2, 1, 2), (1, 2, 4)], ids=["1-1-1", "tp2", "pp2-dp2"])
def test_saved_at_2_2_2_loads_into_another_layout(uninterrupted, saved_at_2_2_2, tmp_path, tp, pp, ranks):
    run = tmp_path / "run"
    shutil.copytree(saved_at_2_2_2, run, symlinks=True)  # a run directory moved elsewhere resumes as well
    result = _run(_spec(tmp_path / "second.yaml", tp=tp, pp=pp, ranks=ranks), run, "--reuse")
    assert "resumed from checkpoint step 10 (new layout: resharded)" in result.stdout
    losses = _losses(run)
    assert max(abs(losses[k] - uninterrupted[k]) / abs(uninterrupted[k]) for k in uninterrupted) <= 1e-5


def _load(root: Path) -> dict:
    out = ckpt_job(str(root), "load")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


@pytest.mark.parametrize("point", ["data_written@1", "data_durable@0", "index_written"])
def test_killed_during_a_save_leaves_the_previous_checkpoint(mpi, tmp_path, point):
    root = tmp_path / "ckpt"
    assert ckpt_job(str(root), "save", "1").returncode == 0
    crashed = ckpt_job(str(root), "save", "2", env={"HPCSCALE_CKPT_FAULT": point})
    assert crashed.returncode != 0
    assert list(root.glob(".tmp-*")), "the crash should have left a partial save"
    assert not (root / "step-00000002").exists()
    assert run_cli("ckpt", "verify", str(root / "step-00000001")).returncode == 0
    assert _load(root) == {"step": 1, "matches": True}
    assert not list(root.glob(".tmp-*")), "leftovers are cleaned when the next run starts"


def test_killed_during_gc_never_breaks_a_kept_checkpoint(mpi, tmp_path):
    root = tmp_path / "ckpt"
    assert ckpt_job(str(root), "save", "1", "2", "3").returncode == 0
    crashed = ckpt_job(str(root), "save", "4", env={"HPCSCALE_CKPT_FAULT": "gc", "KEEP": "1"})
    assert crashed.returncode != 0
    assert run_cli("ckpt", "verify", str(root / "step-00000004")).returncode == 0
    assert _load(root) == {"step": 4, "matches": True}
    gc = run_cli("ckpt", "gc", str(root), "--keep", "1", "--json")
    assert json.loads(gc.stdout)["kept"] == [4]
    assert run_cli("ckpt", "verify", str(root / "step-00000004")).returncode == 0


def test_incremental_save_writes_only_changed_chunks(mpi, tmp_path):
    root = tmp_path / "ckpt"
    assert ckpt_job(str(root), "save", "1", "1").returncode == 0  # the same step twice: second is a no-op
    infos = json.loads(run_cli("ckpt", "ls", str(root), "--json").stdout)["checkpoints"]
    assert len(infos) == 1
    # saving different steps rewrites changed tensors, and the frozen one is referenced, not rewritten
    assert ckpt_job(str(root), "save", "2").returncode == 0
    infos = {i["step"]: i for i in json.loads(run_cli("ckpt", "ls", str(root), "--json").stdout)["checkpoints"]}
    # into a pipe (not a terminal) the table is whole: no column cut to fit 80 characters
    table = run_cli("ckpt", "ls", str(root), env={"COLUMNS": ""}).stdout
    assert "verified" in table and "…" not in table and max(map(len, table.splitlines())) > 80, table
    frozen = 512 * 512 * 4
    assert infos[2]["bytes"] == infos[1]["bytes"]
    assert infos[2]["new_bytes"] == infos[2]["bytes"] - frozen


@pytest.fixture()
def saved(ckpt_saved_1_2, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt_saved_1_2, root)
    return root


def _first_chunk(step_dir: Path):
    from hpcscale.ckpt.format import INDEX, read_index

    index = read_index(step_dir / INDEX)
    # a chunk stored in this step's own files (others may be shared with the previous checkpoint)
    for name in sorted(index.tensors):
        for chunk in index.tensors[name].shards[0].chunks:
            if chunk.file.startswith(step_dir.name + "/"):
                return name, chunk
    raise AssertionError("no chunk of its own")


def test_flipped_byte_fails_verify_with_exit_3_and_load_falls_back(saved):
    name, chunk = _first_chunk(saved / "step-00000002")
    path = saved / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    result = run_cli("ckpt", "verify", str(saved / "step-00000002"))
    assert result.returncode == 3
    assert f"tensor {name}: chunk {chunk.hash}" in result.stderr and "does not match its hash" in result.stderr
    out = ckpt_job(str(saved), "load")
    assert "refusing checkpoint step-00000002" in out.stderr + out.stdout
    assert json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{"))) == {
        "step": 1,
        "matches": True,
    }


def _damage_last_chunk(step_dir: Path) -> str:
    """Flip a byte of the chunk a load reads last (file order), so the load has written the rest first."""
    from hpcscale.ckpt.format import INDEX, read_index

    index = read_index(step_dir / INDEX)
    chunks = [(n, c) for n, t in index.tensors.items() for s in t.shards for c in s.chunks]
    name, chunk = max(chunks, key=lambda x: (x[1].file, x[1].offset))
    path = step_dir.parent / chunk.file
    with open(path, "r+b") as f:
        f.seek(chunk.offset)
        byte = f.read(1)
        f.seek(chunk.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


def test_every_checkpoint_refused_after_partial_reads_starts_truly_from_scratch(mpi, tmp_path):
    """Chunks are read straight into the model and hashed there: a checkpoint refused at its last chunk has
    overwritten everything else. With no older one left, the built-in trainer must build its model again, or
    its "fresh start" trains on from the refused checkpoint's weights."""
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=2, steps=10, checkpoint={"every_steps": 5})
    run = tmp_path / "run"
    _run(job, run)
    reference = _losses(run)  # the first attempt: a true start from scratch
    steps = sorted(p for p in (run / "checkpoints").glob("step-*"))
    assert [p.name for p in steps] == ["step-00000005", "step-00000010"]
    for step_dir in steps:
        _damage_last_chunk(step_dir)
    again = _run(job, run, "--reuse")
    assert "refusing checkpoint step-00000010" in again.stdout + again.stderr
    assert "built again from the seed" in again.stdout + again.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in rows if "loss" in r and r.get("attempt") == 2} == reference


def test_load_latest_says_when_a_refused_load_touched_the_tensors(tmp_path):
    """tensors_dirty: set when no checkpoint loaded after a refused one wrote into the tensors; not when the
    refusal came before any read (a damaged index), nor when an older checkpoint loaded over everything."""
    import torch
    import torch.distributed as dist

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    g = torch.Generator().manual_seed(5)
    saved = {f"w{i}": torch.randn(64, 64, generator=g) for i in range(6)}
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        m = CheckpointManager(tmp_path, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0)
        m.save(1, saved, {}, asynchronous=False)
        first = {k: v.clone() for k, v in saved.items()}
        for t in saved.values():
            t.add_(1)
        m.save(2, saved, {}, asynchronous=False)
        _damage_last_chunk(tmp_path / "step-00000002")
        fresh = {k: torch.full_like(v, -3.0) for k, v in saved.items()}
        assert m.load_latest(fresh).step == 1 and not m.tensors_dirty  # step 1 overwrote every element
        assert all(torch.equal(fresh[k], first[k]) for k in saved)
        _damage_last_chunk(tmp_path / "step-00000001")
        fresh = {k: torch.full_like(v, -3.0) for k, v in saved.items()}
        assert m.load_latest(fresh) is None and m.tensors_dirty
        assert any(not torch.equal(v, torch.full_like(v, -3.0)) for v in fresh.values())  # what the flag is for
        for step in (1, 2):  # an index that fails its digest is refused before any chunk is read
            (tmp_path / f"step-0000000{step}" / "DIGEST").write_text("0" * 32 + "\n")
        fresh = {k: torch.full_like(v, -3.0) for k, v in saved.items()}
        assert m.load_latest(fresh) is None and not m.tensors_dirty
        assert all(torch.equal(v, torch.full_like(v, -3.0)) for v in fresh.values())
    finally:
        dist.destroy_process_group()


def test_truncated_data_file_fails_verify(saved):
    _, chunk = _first_chunk(saved / "step-00000002")
    path = saved / chunk.file
    os.truncate(path, path.stat().st_size // 2)
    result = run_cli("ckpt", "verify", str(saved / "step-00000002"))
    assert result.returncode == 3 and "truncated" in result.stderr


def test_damaged_index_fails_verify_and_ls_reports_it(saved):
    index = saved / "step-00000002" / "index.h5"
    data = bytearray(index.read_bytes())
    data[0:64] = b"\0" * 64
    index.write_bytes(bytes(data))
    result = run_cli("ckpt", "verify", str(saved / "step-00000002"))
    assert result.returncode == 3 and "damaged index" in result.stderr
    infos = {i["step"]: i for i in json.loads(run_cli("ckpt", "ls", str(saved), "--json").stdout)["checkpoints"]}
    assert infos[1]["verified"] == "ok" and "damaged index" in infos[2]["verified"]
    assert _load(saved) == {"step": 1, "matches": True}


def test_inspect_and_export(saved, tmp_path):
    doc = json.loads(run_cli("ckpt", "inspect", str(saved / "step-00000002"), "--json").stdout)
    assert doc["step"] == 2 and doc["world_size"] == 2 and doc["layout"] == {"pp": 1, "dp": 2, "tp": 1}
    assert {t["name"] for t in doc["tensors"]} == {f"w{i}" for i in range(6)} | {"frozen"}
    # export takes model/ tensors: this store has none, so it exports an empty model
    out = run_cli("ckpt", "export", str(saved / "step-00000002"), "-o", str(tmp_path / "m.st"), "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["tensors"] == 0
    # the checkpoints root (or a run directory) means its newest committed checkpoint
    newest = json.loads(run_cli("ckpt", "inspect", str(saved), "--json").stdout)
    assert newest["step"] == 2
    again = run_cli("ckpt", "export", str(saved), "-o", str(tmp_path / "m2.st"), "--json")
    assert again.returncode == 0 and (tmp_path / "m2.st").exists()
    # a path with no checkpoint is the user's mistake (exit 2), not damage (exit 3); nothing is written
    for cmd in (["inspect"], ["verify"], ["export", "-o", str(tmp_path / "m3.st")]):
        wrong = run_cli("ckpt", cmd[0], str(tmp_path), *cmd[1:])
        assert wrong.returncode == 2 and "no committed checkpoint" in wrong.stderr, (cmd, wrong.stderr)
    assert not (tmp_path / "m3.st").exists()


def test_export_of_a_trained_model_loads_with_safetensors(run_2x2x2, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_2x2x2, run, symlinks=True)
    out = tmp_path / "model.safetensors"
    result = run_cli("ckpt", "export", str(run / "checkpoints" / "step-00000020"), "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file

    weights = load_file(str(out))
    assert weights["layers.0.attn.q.weight"].shape == (32, 32)  # full, not a tp shard
    assert "tok_emb.weight" in weights and "output.weight" in weights  # first and last pipeline stages
    status = json.loads(run_cli("status", str(run), "--json").stdout)
    assert status["latest_checkpoint"]["step"] == 20


@pytest.mark.parametrize("kernel", ["fused", "foreach", "data", "no_grad_copy"])
def test_every_save_holds_what_the_tensors_hold_whatever_updated_them(group, tmp_path, kernel):
    """torch's fused and foreach AdamW kernels (the defaults on GPUs), writes through `.data` and copies under
    no_grad change a tensor without moving the version counter a save could look at, and state_dict() hands
    out fresh objects whose id() is reused: the second save must still hold the values after the update, and
    an unchanged tensor must still cost no bytes (its chunks hash to what is stored)."""
    import torch

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    frozen = torch.arange(1000, dtype=torch.float32)
    opt = None
    if kernel in ("fused", "foreach"):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, **{kernel: True})

    def update() -> None:
        if opt is not None:
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        elif kernel == "data":
            model.weight.data.mul_(0.5)
            model.bias.data.add_(1.0)
        else:
            with torch.no_grad():
                model.weight.copy_(model.weight * 0.5)
                model.bias.copy_(model.bias + 1.0)

    def state() -> dict:  # fresh objects every call, as a trainer's state_dict() gives
        out = {f"model/{k}": v for k, v in model.state_dict().items()} | {"frozen": frozen}
        if opt is not None:
            for i, s in opt.state_dict()["state"].items():
                out |= {f"optim/{i}/{k}": v for k, v in s.items() if v.dim() > 0}
        return out

    m = CheckpointManager(tmp_path, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0)
    update()  # the optimizer's state exists before the first save
    m.save(1, state(), {}, asynchronous=True)
    m.wait()
    update()
    expected = {k: v.clone() for k, v in state().items()}
    m.save(2, state(), {}, asynchronous=kernel != "data")
    m.wait()
    loaded = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    fresh = CheckpointManager(tmp_path, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, read_only=True)
    assert fresh.load_latest(loaded, check_rng=False).step == 2
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    # the frozen tensor cost nothing at the second save: its one chunk was referenced
    sync = m.save(3, {"frozen": frozen}, {}, asynchronous=False)
    assert sync.new_bytes == 0 and sync.referenced_bytes == 4000


def test_load_reads_across_padding_in_few_preadvs_and_shared_chunks_once(tmp_path, monkeypatch):
    """Small tensors make chunks padded to ALIGN in an O_DIRECT data file. The load reads through the padding
    (one preadv for the lot, not one per 2 KiB bias), never trusts or checks what the padding holds, reads a
    chunk two tensors share once, and still names the tensor whose bytes were damaged mid-run."""
    import torch
    import torch.distributed as dist

    from hpcscale.ckpt import reader
    from hpcscale.ckpt.format import INDEX, read_index, step_dir_name
    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.ckpt.shards import local_shards
    from hpcscale.ckpt.writer import ALIGN
    from hpcscale.errors import VerificationFailure
    from hpcscale.layout import ParallelDims

    g = torch.Generator().manual_seed(3)
    tensors = {f"bias{i:02d}": torch.randn(512, generator=g) for i in range(40)}  # 2 KiB each: padded
    tensors["weight"] = torch.randn(256, 256, generator=g)
    tensors["ones_a"], tensors["ones_b"] = torch.ones(300), torch.ones(300)  # one chunk, referenced twice
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        m = CheckpointManager(tmp_path, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, direct_io=True)
        m.save(1, tensors, {}, asynchronous=False)
    finally:
        dist.destroy_process_group()
    index = read_index(tmp_path / step_dir_name(1) / INDEX)
    refs = sorted({c for t in index.tensors.values() for s in t.shards for c in s.chunks}, key=lambda c: c.offset)
    assert len({c.file for c in refs}) == 1
    data = tmp_path / refs[0].file
    gaps = [(a.offset + a.length, b.offset) for a, b in itertools.pairwise(refs) if b.offset > a.offset + a.length]
    assert len(gaps) >= 40 and all(0 < b - a < ALIGN for a, b in gaps)  # the direct path padded the biases
    with open(data, "r+b") as f:  # garbage in every gap: nothing references it, so nothing may refuse it
        for a, b in gaps:
            f.seek(a)
            f.write(b"\xff" * (b - a))

    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(reader.os, "preadv", lambda fd, bufs, at: calls.append(len(bufs)) or real_preadv(fd, bufs, at))
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    nbytes = reader.load_shards(index, tmp_path, local_shards(out))
    for k, v in tensors.items():
        assert torch.equal(out[k], v), k
    assert len(calls) == 1  # under RUN_BYTES, no gap over GAP_BYTES: one run
    assert nbytes == refs[-1].offset + refs[-1].length - refs[0].offset  # padding read, the shared chunk once

    victim = index.tensors["bias17"].shards[0].chunks[0]
    with open(data, "r+b") as f:
        f.seek(victim.offset + 100)
        byte = f.read(1)
        f.seek(victim.offset + 100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(VerificationFailure, match=r"bias17.*hash mismatch"):
        reader.load_shards(index, tmp_path, local_shards({k: torch.zeros_like(v) for k, v in tensors.items()}))


@pytest.mark.parametrize("direct", [True, False])
def test_data_file_round_trips_odd_chunks_from_aligned_and_unaligned_memory(tmp_path, direct):
    """O_DIRECT needs aligned memory, offsets and lengths; chunks of any length from anywhere must still land
    intact at the offsets `append` returns, with nothing else in the file referenced."""
    import torch

    from hpcscale.ckpt.writer import ALIGN, SLOT, SLOTS, DataFile, aligned_empty

    g = torch.Generator().manual_seed(0)
    aligned = aligned_empty(torch.Size([3 * ALIGN + 123]), torch.uint8)
    aligned.copy_(torch.randint(0, 256, aligned.shape, generator=g, dtype=torch.uint8))
    backing = torch.randint(0, 256, (5 * SLOT,), generator=g, dtype=torch.uint8)
    skew = 1 if backing.data_ptr() % ALIGN == 0 else 0
    chunks = [
        aligned,  # aligned body written in place, partial last block through a bounce slot
        backing[skew + 7 : skew + 7 + 2 * ALIGN + 5],  # unaligned start: all through a bounce slot
        torch.empty(0, dtype=torch.uint8),
        aligned[: 2 * ALIGN],  # aligned and whole blocks: no bounce at all
        backing[skew : skew + 4 * SLOT + 3],  # more pieces than slots: the ring is reused while writes run
        backing[skew + 1 : skew + 4],
    ]
    bounce = aligned_empty(torch.Size([SLOTS * SLOT]), torch.uint8)
    reserve = 16 * SLOT  # more than is written: what is left over must be given back
    f = DataFile(tmp_path / "rank.bin", direct=direct, bounce=bounce, reserve=reserve)
    assert f.direct == direct  # ext4 under the test's tmp takes O_DIRECT: the direct path really ran
    assert f.reserved == (reserve if direct else 0)  # and it takes fallocate
    offsets = [f.append(c) for c in chunks]
    f.close(sync=True)
    data = (tmp_path / "rank.bin").read_bytes()
    assert len(data) == f.offset < reserve
    for c, off in zip(chunks, offsets, strict=True):
        assert data[off : off + c.numel()] == bytes(c.numpy())
        assert not direct or off % ALIGN == 0


def test_a_deferred_async_save_holds_the_tensors_as_they_were_when_staged(tmp_path):
    """defer_staging: save() returns before the copy; after wait_staged() the caller changes the tensors in
    place, and the checkpoint still holds the values of the save's moment, hashes verified on load."""
    import torch
    import torch.distributed as dist

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.layout import ParallelDims

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        m = CheckpointManager(tmp_path, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0)
        g = torch.Generator().manual_seed(0)
        state = {f"w{i}": torch.randn(512, 256, generator=g) for i in range(8)}
        expected = {k: v.clone() for k, v in state.items()}
        stats = m.save(1, state, {"step": 1}, asynchronous=True, defer_staging=True)
        m.wait_staged()
        for t in state.values():  # the optimizer step, while the write may still run
            t.mul_(-3.0)
        m.wait()
        assert stats.step == 1 and m.last_step == 1
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        fresh = CheckpointManager(tmp_path, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0)
        restored = fresh.load_latest(target)
        assert restored is not None and restored.step == 1
        assert all(torch.equal(target[k], expected[k]) for k in state)
        m.wait_staged()  # nothing pending: returns at once
    finally:
        dist.destroy_process_group()


def test_async_saves_share_one_low_priority_thread_that_survives_a_failed_save(tmp_path):
    """Every async save runs on one long-lived thread at checkpoint.background_nice (the loop's threads get a
    core first); a failed save is raised by wait() and the next save still commits on the same thread."""
    import threading

    import torch
    import torch.distributed as dist

    from hpcscale.ckpt.manager import CheckpointManager
    from hpcscale.errors import RuntimeFailure
    from hpcscale.layout import ParallelDims

    before = set(threading.enumerate())  # other tests' managers' threads live on (daemons, idle)

    def writer_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "hpcscale-ckpt-0" and t not in before]

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        m = CheckpointManager(tmp_path / "a", dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, background_nice=7)
        state = {"w": torch.randn(256, 256)}
        m.save(1, state, {"step": 1}, asynchronous=True)
        m.wait()
        (thread,) = writer_threads()
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == min(19, base + 7)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's own priority untouched
        state["w"].add_(1.0)
        m.save(2, state, {"step": object()}, asynchronous=True, defer_staging=True)  # commit cannot record it
        m.wait_staged()
        with pytest.raises(RuntimeFailure, match="step 2"):
            m.wait()
        state["w"].add_(1.0)
        m.save(3, state, {"step": 3}, asynchronous=True)
        m.wait()
        assert m.last_step == 3 and writer_threads() == [thread] and thread.is_alive()
        target = {"w": torch.zeros(256, 256)}
        restored = CheckpointManager(tmp_path / "a", dims=ParallelDims(pp=1, dp=1, tp=1), rank=0).load_latest(target)
        assert restored is not None and restored.step == 3 and torch.equal(target["w"], state["w"])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("rank_nice", "thread_nice"), [(5, 12), (15, 19)])
def test_background_nice_is_added_to_the_ranks_own_and_capped(tmp_path, rank_nice, thread_nice):
    """background_nice raises the writer thread's nice value above the rank's (a rank started under `nice`),
    capped at 19; it never gives the thread a higher priority than the rank has."""
    code = f"""
import os, pathlib, threading, torch, torch.distributed as dist
from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.layout import ParallelDims
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
m = CheckpointManager(pathlib.Path({str(tmp_path)!r}), dims=ParallelDims(pp=1, dp=1, tp=1), rank=0,
                      background_nice=7)
m.save(1, {{"w": torch.ones(4)}}, {{}}, asynchronous=True)
m.wait()
(t,) = [t for t in threading.enumerate() if t.name == "hpcscale-ckpt-0"]
print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, t.native_id))
"""
    done = subprocess.run(
        ["nice", "-n", str(rank_nice), sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(rank_nice), str(thread_nice)]


def test_a_commit_killed_before_renaming_latest_leaves_no_temporary_for_ever(tmp_path):
    """LATEST is replaced through a temporary of a random name (hpcscale.portable.files.atomic_write); a kill -9
    between its create and its rename leaves one. The job's own cleanup (at its start and after each commit)
    removes it; `ckpt gc`, which may run beside a live job, leaves it."""
    from hpcscale.ckpt.retention import remove_unfinished

    root = tmp_path / "checkpoints"
    root.mkdir()
    stale = root / ".LATEST.0123456789abcdef.tmp"
    stale.write_text("step-00000005\n")
    (root / ".LATEST.link.tmp").symlink_to(tmp_path / "elsewhere")  # never followed, never removed
    assert remove_unfinished(root) == [] and stale.exists()  # gc beside a live job: not its to remove
    remove_unfinished(root, all_of_them=True)
    assert not stale.exists() and (root / ".LATEST.link.tmp").is_symlink()

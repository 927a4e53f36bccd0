"""Efficiency per step (docs/observability.md#efficiency): model FLOPs counted from the model itself, against
hand-computed counts for the reference GPT at several layouts and for a user's model; TFLOPS per device and MFU
against a peak from the site config; memory; what status and report show of them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from trainjobs import PARAMS, job_spec

from hpcscale.launch.efficiency import PEAK_TFLOPS, StepFlops, memory_gauges, peak_for

VOCAB = 256  # the built-in trainer's byte-level tokens


# ---- peaks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.1),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("AMD Instinct MI300X", 1307.4),
        ("Tesla V100-SXM2-32GB", 125.0),
    ],
)
def test_a_device_is_known_by_the_words_of_its_name(name, peak):
    assert peak_for(name) == (peak, "table")


def test_the_site_names_a_peak_first_and_a_cpu_has_none_unless_named():
    assert peak_for("cpu") == (None, None)
    assert peak_for("NVIDIA RTX 9000 Hypothetical") == (None, None)
    assert peak_for("cpu", {"cpu": 2.5}) == (2.5, "site")
    # the site's figure wins over the table's, and its key with most words over a shorter one
    site = {"h100": 900.0, "h100 sxm5 lowpower": 700.0}
    assert peak_for("NVIDIA H100 80GB HBM3", site) == (900.0, "site")
    assert peak_for("NVIDIA H100 SXM5 80GB LowPower", site) == (700.0, "site")
    # a key matches whole words: "a10" is not the A100's
    assert peak_for("NVIDIA A10") == (125.0, "table") and peak_for("NVIDIA A100 80GB PCIe") == (312.0, "table")


@given(name=st.text(max_size=60), site=st.dictionaries(st.text(max_size=20), st.floats(0.1, 1e4), max_size=4))
@settings(max_examples=300, deadline=None)
def test_any_device_name_gets_a_peak_of_a_key_whose_words_it_has_or_none(name, site):
    peak, source = peak_for(name, site)
    assert source in (None, "site", "table")
    if source is None:
        assert peak is None
        return
    table = site if source == "site" else PEAK_TFLOPS

    def words(text: str) -> list[str]:  # letters and digits, lower case: what a name and a key are compared by
        return [w for w in re.split(r"[^a-z0-9]+", text.lower()) if w]

    assert any(v == peak and words(key) and set(words(key)) <= set(words(name)) for key, v in table.items())


# ---- the counter, in this process ----------------------------------------------------------------------------
def test_the_counter_counts_products_and_attention_as_model_flops_and_skips_a_suspended_span():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64, bias=False), torch.nn.Linear(64, 16, bias=False))
    x = torch.randn(8, 16)
    counter = StepFlops()
    counter.begin()
    model(x).sum().backward()
    counter.suspend()
    with torch.no_grad():
        model(torch.randn(100, 16))  # not counted
    counter.resume()
    # attention: b=2, heads=4, T=32, head 8; forward QK^T and AV, the backward twice the forward (no recompute)
    q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    total = counter.end()
    products = 5 * 2 * 8 * 16 * 64  # two forward, two for the second layer's backward, one weight gradient
    attention = 3 * 2 * (2 * (2 * 4) * 32 * 32 * 8)
    assert total == products + attention
    assert not counter.counting


def test_a_gpus_counters_are_read_through_nvml_or_the_reader_says_why_not():
    """Here (no driver) the real nvidia-ml-py says why it reads nothing; on a GPU machine the counters read."""
    from hpcscale.launch.nvml import open_counters

    assert open_counters(torch.device("cpu")) == (None, "not measured on CPU ranks (no energy counter)")
    counters, why = open_counters(torch.device("cuda", 0))
    if counters is None:  # no NVIDIA driver on this machine: its library is not there
        assert why.startswith("not measured: NVML: ") and "Not Found" in why, why
    else:  # a GPU machine: the figures NVML gives, this attempt's energy from 0
        got = counters.read()
        assert got["energy_j"] >= 0 and 0 <= got["gpu_util"] <= 100 and got["sm_clock_mhz"] > 0, got


def test_a_model_that_went_through_torch_compile_is_seen_so():
    """Such a model is not counted (dynamo does not compile under the counter's dispatch mode): the formula."""
    from hpcscale.launch.efficiency import compiled

    plain = torch.nn.Linear(2, 2)
    assert not compiled([plain, torch.nn.Sequential(plain)])
    assert compiled([torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2)))])  # wrapped: an OptimizedModule
    plain.compile()  # in place
    assert compiled([torch.nn.Sequential(plain)])


def test_memory_on_a_cpu_rank_is_the_hosts_peak_alone():
    gauges = memory_gauges(torch.device("cpu"))
    assert set(gauges) == {"rss_gb"} and 0.01 < gauges["rss_gb"] < 100


# ---- whole jobs -----------------------------------------------------------------------------------------
def _site(tmp_path: Path, peak: float) -> Path:
    site = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    site["name"] = "local-peak"
    site["devices"] = {"peak_tflops": {"cpu": peak}}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def gpt_flops_per_token(*, tp: int) -> int:
    """The reference GPT's FLOPs per token by hand: per layer the q, k, v, o products (4 x 2d²), the MLP's
    (2 x 8d²), attention's QK^T and AV over the whole sequence (2 x 2Td); the output head (2dV); the backward
    twice the forward. Under tp the head, which the plan leaves whole, is computed on every tp rank."""
    d, T, L = PARAMS["n_embd"], PARAMS["seq_len"], PARAMS["n_layer"]
    forward = L * (24 * d * d + 4 * T * d) + 2 * d * VOCAB
    return 3 * forward + (tp - 1) * 3 * 2 * d * VOCAB


@pytest.mark.parametrize(
    "layout",
    [{"tp": 1, "pp": 1, "ranks": 2}, {"tp": 2, "pp": 2, "ranks": 4}, {"tp": 1, "pp": 1, "ranks": 2, "dp_shard": 2}],
)
def test_the_reference_gpt_counts_its_hand_computed_flops_and_its_mfu_is_against_the_sites_peak(mpi, tmp_path, layout):
    peak = 0.05
    job = job_spec(tmp_path / "job.yaml", **layout, steps=6, gpu_defaults=False)
    spec = yaml.safe_load(job.read_text())
    spec["site"] = str(_site(tmp_path, peak))
    spec["metrics"] = {"timing_every": 3}
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    out = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run)
    record = next(r["model_flops"] for r in rows if "model_flops" in r)
    tokens = PARAMS["global_batch"] * PARAMS["seq_len"]
    assert record["source"] == "counted" and record["devices"] == layout["ranks"]
    assert record["flops_per_step"] == gpt_flops_per_token(tp=layout["tp"]) * tokens
    assert record["peak_tflops"] == peak and record["peak_source"] == "site" and record["device"] == "cpu"
    assert record["energy"] == "not measured on CPU ranks (no energy counter)"
    assert "model FLOPs" in out.stdout and f"MFU against {peak:g} TFLOPS per cpu (site)" in out.stdout
    lines = [r for r in rows if "loss" in r]
    assert "tflops" not in lines[0]  # the first step is not counted: nothing is known of it yet
    for r in lines[1:]:  # from the counted step on: the step's FLOPs over its time, per device, over the peak
        want = record["flops_per_step"] / r["step_time_s"] / layout["ranks"] / 1e12
        assert math.isclose(r["tflops"], want, rel_tol=1e-3, abs_tol=1e-6)
        assert math.isclose(r["mfu"], r["tflops"] / peak, rel_tol=1e-3, abs_tol=1e-5)
        assert 0.01 < r["rss_gb"] < 50 and "mem_gb" not in r  # the host's peak; no device memory on a CPU
    timing = [json.loads(line) for line in (run / "timing.jsonl").read_text().splitlines()]
    assert all(len(t["ranks"]) == layout["ranks"] and "rss_gb" in t["columns"] for t in timing)
    status = run_cli("status", str(run))
    assert status.returncode == 0, status.stderr
    assert "efficiency: MFU " in status.stdout and "TFLOPS per device" in status.stdout
    assert "(counted)" in status.stdout and "host memory peak" in status.stdout
    assert "energy not measured on CPU ranks" in status.stdout
    report = run_cli("report", str(run), "-o", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "efficiency.png" in summary and "| efficiency (median) | MFU " in summary
    assert "| GPU energy | not measured (no NVML reading) |" in summary and "| node-hours, GPU-hours | " in summary
    assert (tmp_path / "report" / "efficiency.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("mode", ["count", "formula"])
def test_a_users_model_counts_its_products_or_takes_the_formula(mpi, tmp_path, mode):
    ranks, batch, steps = 2, 8, 4
    spec = {
        "name": "flops-user",
        "site": "local",
        "nodes": 1,
        "tasks_per_node": ranks,
        "timeout_seconds": 60,
        "environment": {"PYTHONPATH": str(REPO / "tests" / "helpers")},
        "metrics": {"flops": mode},
        "train": {"entry": "flops_entry:main", "params": {"batch": batch, "steps": steps}},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    run = tmp_path / "run"
    out = run_cli("run", str(job), "--local", "--run-dir", str(run), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run)
    records = [r for r in rows if "model_flops" in r]
    assert len(records) == 1
    record = records[0]["model_flops"]
    tokens = batch * ranks
    if mode == "count":  # at the second step; the evaluation inside it left out
        assert records[0]["step"] == 1
        assert record["source"] == "counted" and record["flops_per_step"] == ranks * 5 * 2 * batch * 16 * 64
    else:  # at the first step: 6 x parameters x tokens
        assert records[0]["step"] == 0
        assert record["source"] == "formula" and record["parameters"] == 2 * 16 * 64
        assert record["flops_per_step"] == 6 * 2 * 16 * 64 * tokens
    assert record["flops_per_token"] == record["flops_per_step"] / tokens
    assert record["peak_tflops"] is None and "no peak known for cpu" in out.stdout
    timed = [r for r in rows if "step_time_s" in r and r["step"] >= records[0]["step"]]
    assert timed and all("tflops" in r and "mfu" not in r for r in timed)


def test_a_counted_step_is_bitwise_an_uncounted_one():
    """The counter runs every operation as it runs uncounted: torch's own mode runs the decomposition of one it
    has no formula for (other kernels, other rounding), and a Llama's step under it (transformers, from a config)
    came out a float32 ulp off; a resumed run, counted at another step than the uninterrupted one, then left its
    weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(counted: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        counter = StepFlops()
        if counted:
            counter.begin()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if counted:
            assert counter.end() > 0
        return loss.detach(), [p.grad for p in model.parameters()]

    (loss, grads), (loss_counted, grads_counted) = step(False), step(True)
    assert torch.equal(loss, loss_counted)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_counted, strict=True))

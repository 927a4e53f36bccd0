"""Cross-site record files (hpcscale/xsite/roundfile.py, signing.py; docs/cross-site-format.md): what is written
reads back exactly, and everything else from another site (unsigned, forged, replayed, tampered, oversized,
symlinked, malformed) is Rejected with a reason, never another exception, and quickly."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import struct
import tempfile
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.xsite import roundfile as rf
from hpcscale.xsite import signing

# CPU seconds of the reading process: "refused in well under a second" (its CPU, not the wall clock, which a
# loaded machine stretches while the process waits for a core: a bomb or a quadratic parse still shows)
QUICK = 0.5
COMPRESSED_FIELDS = {"payload_compression", "payload_raw_bytes"}


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    for site in ("a", "b", "agg"):
        signing.generate_key(d, site)
    return d


@pytest.fixture(scope="module")
def keys(keydir) -> dict[str, object]:
    return {site: signing.load_private(keydir / f"{site}.key") for site in ("a", "b", "agg")}


@pytest.fixture(scope="module")
def keyring(keydir) -> signing.Keyring:
    return signing.load_keyring(keydir)


SITES = {"a", "b"}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layers.0.w": torch.randn(3, 4, generator=g), "layers.0.b": torch.randn(4, generator=g)}


def _contrib(
    directory: Path,
    key,
    *,
    site: str = "a",
    base: int = 3,
    encoding: str = "fp32",
    tensors=None,
    compression="none",
    bound: bool = False,
) -> Path:
    binding = {"training": "fmt:" + "ab" * 16, "base_theta_sha256": rf.theta_digest(_tensors())} if bound else {}
    return rf.write_contribution(
        directory,
        site=site,
        base_round=base,
        steps=100,
        tokens=12345,
        encoding=encoding,
        tensors=_tensors() if tensors is None else tensors,
        key=key,
        compression=compression,
        **binding,
    )


def _read(path: Path, keyring, **kw) -> rf.Contribution:
    kw.setdefault("known_sites", SITES)
    return rf.read_contribution(path, keyring=keyring, **kw)


def _rejected(path: Path, keyring, read=None, **kw) -> str:
    """The reason `path` is rejected; fails if it is accepted or takes long."""
    t0 = time.process_time()
    with pytest.raises(rf.Rejected) as e:
        (read or _read)(path, keyring, **kw)
    assert time.process_time() - t0 < QUICK
    assert str(path) in str(e.value)
    return e.value.reason


def _resign(path: Path, key, change) -> None:
    """Edit the record's fields with `change(doc)`, then sign and write it again, canonically, as a forger with
    `key` would."""
    doc = json.loads(path.read_bytes())
    doc.pop("signature", None)
    change(doc)
    if key is not None:
        doc["key_id"] = signing.key_id(key.public_key())
        doc["signature"] = signing.sign(key, rf.canonical_json(doc))
    path.write_bytes(rf.canonical_json(doc) + b"\n")


def _repayload(path: Path, key, payload: bytes, **fields) -> None:
    """Replace the payload with `payload` and sign a record that matches its size and hash (and `fields`)."""
    path.with_suffix(".safetensors").write_bytes(payload)
    _resign(
        path,
        key,
        lambda doc: doc.update(
            payload_bytes=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest(), **fields
        ),
    )


# ---- round trips ----


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("encoding", ["fp32", "bf16", "int8"])
def test_contribution_round_trip(tmp_path, keys, keyring, encoding, compression):
    tensors = _tensors()
    if encoding == "bf16":
        tensors = {n: t.bfloat16() for n, t in tensors.items()}
    if encoding == "int8":  # the codes and their fp32 offsets and steps, as outer.encode writes them
        tensors = {"w/q": torch.arange(12, dtype=torch.uint8), "w/lo": torch.zeros(1), "w/step": torch.ones(1)}
    path = _contrib(tmp_path, keys["a"], encoding=encoding, tensors=tensors, compression=compression)
    doc = json.loads(path.read_bytes())
    raw = safetensors.torch.save(tensors)
    if compression == "none":
        assert COMPRESSED_FIELDS.isdisjoint(doc) and path.with_suffix(".safetensors").read_bytes() == raw
    else:
        assert (doc["payload_compression"], doc["payload_raw_bytes"]) == ("zstd", len(raw))
        assert zstandard.decompress(path.with_suffix(".safetensors").read_bytes()) == raw
    assert path.name == "contrib-a-r000003.json"
    assert path.with_suffix(".safetensors").is_file()
    c = _read(path, keyring, expected_base_round=3)
    assert (c.site, c.base_round, c.round, c.steps, c.tokens, c.encoding) == ("a", 3, 4, 100, 12345, encoding)
    assert set(c.tensors) == set(tensors) == set(c.specs)
    for name, t in tensors.items():
        assert torch.equal(c.tensors[name], t)
        assert c.specs[name].shape == tuple(t.shape) and c.specs[name].torch_dtype == t.dtype
    assert c.key_id == signing.key_id(keys["a"].public_key())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_round_round_trip(tmp_path, keys, keyring):
    theta = _tensors()
    momentum = {n: t * 0.5 for n, t in theta.items()}
    r0 = rf.write_round(
        tmp_path,
        round=0,
        parent=None,
        outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "mean"},
        accepted=[],
        rejected=[],
        theta=theta,
        momentum={n: torch.zeros_like(t) for n, t in theta.items()},
        key=keys["agg"],
    )
    assert r0.name == "round-000000.json"
    assert rf.read_round(r0, keyring=keyring, aggregator="agg").parent is None
    path = rf.write_round(
        tmp_path,
        round=5,
        parent=4,
        outer=rf.OuterStepRecord(lr=0.7, momentum=0.9, nesterov=True, rule="mean", encoding="bf16"),
        accepted=[rf.AcceptedContribution(site="a", payload_sha256="0" * 64, tokens=10, steps=2)],
        rejected=[{"site": "b", "reason": "payload sha256 mismatch ≠ what was signed"}],
        theta=theta,
        momentum=momentum,
        key=keys["agg"],
    )
    assert path.name == "round-000005.json"
    p = rf.read_round(path, keyring=keyring, aggregator="agg", expected_round=5)
    assert (p.round, p.parent, p.aggregator) == (5, 4, "agg")
    assert p.outer == rf.OuterStepRecord(lr=0.7, momentum=0.9, nesterov=True, rule="mean", encoding="bf16")
    assert p.accepted == (rf.AcceptedContribution(site="a", payload_sha256="0" * 64, tokens=10, steps=2),)
    assert p.rejected == (rf.RejectedContribution(site="b", reason="payload sha256 mismatch ≠ what was signed"),)
    assert set(p.specs) == {f"{k}/{n}" for k in ("theta", "momentum") for n in theta}
    for name in theta:
        assert torch.equal(p.theta[name], theta[name]) and torch.equal(p.momentum[name], momentum[name])


def test_tensors_that_share_memory_are_written(tmp_path, keys, keyring):
    """Tied weights (an embedding used as the output layer), and θ passed as its own momentum: safetensors
    refuses shared storage, so the writer copies; each name reads back with its own values."""
    w = torch.randn(4, 3)
    path = _contrib(tmp_path, keys["a"], tensors={"embed": w, "head": w, "first_row": w[0]})
    c = _read(path, keyring)
    assert torch.equal(c.tensors["embed"], w) and torch.equal(c.tensors["head"], w)
    assert torch.equal(c.tensors["first_row"], w[0])
    theta = {"w": w}
    kw = dict(outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "mean"}, accepted=[], rejected=[])
    r = rf.write_round(tmp_path, round=1, parent=0, theta=theta, momentum=theta, key=keys["agg"], **kw)
    assert torch.equal(rf.read_round(r, keyring=keyring, aggregator="agg").momentum["w"], w)


def test_the_signature_covers_the_canonical_json_of_every_other_field(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    text = path.read_bytes()
    doc = json.loads(text)
    assert text == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    signature = doc.pop("signature")
    signed = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert signing.verify(keyring["a"][0], signed, signature)
    assert doc["payload_sha256"] == hashlib.sha256(path.with_suffix(".safetensors").read_bytes()).hexdigest()


def test_rejected_is_a_verification_failure_exit_3():
    assert issubclass(rf.Rejected, VerificationFailure) and rf.Rejected("x").exit_code == 3
    assert rf.Rejected("why", "/p/f.json").reason == "why"


# ---- each rejection, with its reason ----


def test_one_tampered_payload_byte_is_a_sha256_mismatch(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    payload = path.with_suffix(".safetensors")
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0x01
    payload.write_bytes(bytes(data))
    assert "payload sha256 mismatch" in _rejected(path, keyring)


def test_an_edited_json_field_is_a_bad_signature(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    path.write_bytes(path.read_bytes().replace(b'"tokens":12345', b'"tokens":99999'))
    assert "bad signature" in _rejected(path, keyring)


def test_signed_with_another_sites_key_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    _resign(path, keys["b"], lambda doc: None)  # b signs a record that says site "a"
    assert "signed with the key of site 'b'" in _rejected(path, keyring)
    # the same forgery claiming a's key id: the signature is still b's
    doc = json.loads(path.read_bytes())
    doc["key_id"] = signing.key_id(keys["a"].public_key())
    sig = doc.pop("signature")
    doc["signature"] = signing.sign(keys["b"], rf.canonical_json(doc))
    assert sig != doc["signature"]
    path.write_bytes(rf.canonical_json(doc) + b"\n")
    assert "signed with the key of site 'b'" in _rejected(path, keyring)


def test_a_key_nobody_lists_is_rejected(tmp_path, keys, keyring):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = _contrib(tmp_path, keys["a"])
    _resign(path, Ed25519PrivateKey.generate(), lambda doc: None)
    assert "which the keyring does not list for site 'a'" in _rejected(path, keyring)


@pytest.mark.parametrize("signature", [None, ""])
def test_unsigned_is_rejected(tmp_path, keys, keyring, signature):
    path = _contrib(tmp_path, keys["a"])
    doc = json.loads(path.read_bytes())
    if signature is None:
        del doc["signature"]
    else:
        doc["signature"] = signature
    path.write_bytes(rf.canonical_json(doc) + b"\n")
    assert "unsigned" in _rejected(path, keyring)


@pytest.mark.parametrize("signature", ["!!!", "AAAA", "A" * 85 + "B==", 5, ["x"]])
def test_a_malformed_signature_is_a_bad_signature(tmp_path, keys, keyring, signature):
    path = _contrib(tmp_path, keys["a"])
    _resign(path, None, lambda doc: doc.update(signature=signature))
    assert "bad signature" in _rejected(path, keyring)


def test_the_spare_bits_of_the_base64_signature_cannot_change(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    doc = json.loads(path.read_bytes())
    sig = doc["signature"]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = sig[-3]  # 64 bytes = 86 digits + "==": the 86th digit carries 4 bits that decode to nothing
    doc["signature"] = sig[:-3] + alphabet[alphabet.index(last) ^ 1] + "=="
    assert base64.b64decode(doc["signature"]) == base64.b64decode(sig)
    path.write_bytes(rf.canonical_json(doc) + b"\n")
    assert "bad signature" in _rejected(path, keyring)


def test_a_malleated_signature_is_rejected(keys, keyring):
    """ed25519's S + L verifies under a lax verifier; OpenSSL (through cryptography) refuses it."""
    order = 2**252 + 27742317777372353535851937790883648493
    sig = keys["a"].sign(b"record")
    s = int.from_bytes(sig[32:], "little") + order
    assert s < 2**256
    malleated = base64.b64encode(sig[:32] + s.to_bytes(32, "little")).decode()
    assert signing.verify(keyring["a"][0], b"record", base64.b64encode(sig).decode())
    assert not signing.verify(keyring["a"][0], b"record", malleated)


def test_an_unknown_site_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    assert "unknown site 'a'" in _rejected(path, keyring, known_sites={"b"})


def test_a_site_without_a_key_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    ring = {s: k for s, k in keyring.items() if s != "a"}
    assert "no public key for site 'a'" in _rejected(path, ring)


def test_a_file_name_that_does_not_match_its_site_and_round_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    for suffix in (".json", ".safetensors"):
        path.with_suffix(suffix).rename(tmp_path / f"contrib-b-r000003{suffix}")
    reason = _rejected(tmp_path / "contrib-b-r000003.json", keyring)
    assert "does not match the record" in reason and "contrib-a-r000003.json" in reason


def test_a_replayed_or_future_contribution_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"], base=3)
    assert _rejected(path, keyring, expected_base_round=5).startswith("replayed from round 4")
    assert _rejected(path, keyring, expected_base_round=1) == "for round 4, expected round 2"
    assert _read(path, keyring, expected_base_round=3).base_round == 3


def test_a_replayed_round_or_one_from_another_signer_is_rejected(tmp_path, keys, keyring):
    theta = _tensors()
    kw = dict(outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "mean"}, accepted=[], rejected=[])
    path = rf.write_round(tmp_path, round=2, parent=1, theta=theta, momentum=theta, key=keys["agg"], **kw)

    def read(p, ring, **kw):
        kw.setdefault("aggregator", "agg")
        return rf.read_round(p, keyring=ring, **kw)

    assert _rejected(path, keyring, read, expected_round=3) == "replayed from round 2, expected round 3"
    assert _rejected(path, keyring, read, expected_round=1) == "for round 2, expected round 1"
    assert "must be signed by 'a'" in _rejected(path, keyring, read, aggregator="a")
    (tmp_path / "f").mkdir()
    forged = rf.write_round(tmp_path / "f", round=7, parent=6, theta=theta, momentum=theta, key=keys["a"], **kw)
    assert "signed with the key of site 'a', but it must be signed by 'agg'" in _rejected(forged, keyring, read)


def test_a_contribution_is_not_a_round(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["agg"], site="b")
    reason = _rejected(path, keyring, lambda p, ring: rf.read_round(p, keyring=ring, aggregator="agg"))
    assert reason == 'kind "contribution", expected "round"'


@pytest.mark.parametrize("version", [2, 0, "1", True, None])
def test_an_unknown_format_version_is_rejected(tmp_path, keys, keyring, version):
    path = _contrib(tmp_path, keys["a"])
    _resign(path, keys["a"], lambda doc: doc.update(format_version=version))
    assert "unknown format version" in _rejected(path, keyring)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("tokens", "5", "field 'tokens'"),
        ("steps", -1, "field 'steps'"),
        ("base_round", 1.5, "field 'base_round'"),
        ("base_round", 2**70, "field 'base_round'"),
        ("encoding", "fp8", "field 'encoding'"),
        ("payload_sha256", "ABC", "field 'payload_sha256'"),
        ("created", "yesterday", "field 'created'"),
        ("created", "2025-01-01T00:00:00", "field 'created'"),  # no UTC offset
        ("created", "2025-01-01T00:00:00Z", "field 'created'"),  # Python 3.11 reads it, 3.10 does not: refused
        ("tensors", [], "field 'tensors'"),
        ("tensors", {"__metadata__": {"shape": [1], "dtype": "F32"}}, "invalid tensor name"),
        ("tensors", {"../x": {"shape": [1], "dtype": "F32"}}, "invalid tensor name"),
        ("tensors", {"w": {"shape": [1], "dtype": "F64"}}, "tensors.w.dtype"),
        ("tensors", {"w": {"shape": [1], "dtype": ["F32"]}}, "tensors.w.dtype"),
        ("tensors", {"w": {"shape": [True], "dtype": "F32"}}, "tensors.w.shape"),
        ("tensors", {"w": {"shape": [2**40, 2**40], "dtype": "F32"}}, "tensors.w.shape"),
        ("tensors", {"w": {"shape": [1] * 17, "dtype": "F32"}}, "tensors.w.shape"),
        ("tensors", {"w": {"shape": [1], "dtype": "F32", "x": 1}}, "field 'tensors.w'"),
        ("site", "a/../b", "field 'site'"),
        ("extra", 1, "unknown ['extra']"),
    ],
)
def test_fields_of_the_wrong_type_are_rejected_by_name(tmp_path, keys, keyring, field, value, says):
    path = _contrib(tmp_path, keys["a"])
    _resign(path, keys["a"], lambda doc: doc.update({field: value}))
    assert says in _rejected(path, keyring)


def test_a_missing_field_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    _resign(path, keys["a"], lambda doc: doc.pop("tokens"))
    assert "missing ['tokens']" in _rejected(path, keyring)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("parent", 2, "field 'parent'"),
        ("parent", None, "field 'parent'"),
        ("outer", {"lr": 0.7}, "field 'outer'"),
        ("outer", {"lr": float("1e300"), "momentum": 0.9, "nesterov": True, "rule": "m"}, "outer.lr"),
        ("outer", {"lr": 0.7, "momentum": 2, "nesterov": True, "rule": "m"}, "outer.momentum"),
        ("outer", {"lr": 0.7, "momentum": 0.9, "nesterov": 1, "rule": "m"}, "outer.nesterov"),
        ("outer", {"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "m", "encoding": "x"}, "outer.encoding"),
        ("accepted", [{"site": "a"}], "field 'accepted'"),
        ("accepted", [{"site": "a", "payload_sha256": "x", "tokens": 1, "steps": 1}], "accepted.payload_sha256"),
        ("rejected", [{"site": "", "reason": "r"}], "rejected.site"),
        ("rejected", [{"site": "a", "reason": "r" * 5000}], "rejected.reason"),
        ("tensors", {"theta/w": {"shape": [1], "dtype": "F32"}, "momentum/w": {"shape": [2], "dtype": "F32"}}, "pairs"),
        ("tensors", {"momentum/w": {"shape": [1], "dtype": "F32"}}, "pairs"),
        ("tensors", {}, "pairs"),
        ("tensors", {"theta/w": {"shape": [1], "dtype": "BF16"}}, "tensors.theta/w.dtype"),
        ("training", "no-colon", "field 'training'"),
        ("training", 7, "field 'training'"),
        ("accepted", [{"site": "a", "payload_sha256": "0" * 64, "tokens": 1, "steps": 1, "norm": -1}], "accepted.norm"),
        (
            "accepted",
            [{"site": "a", "payload_sha256": "0" * 64, "tokens": 1, "steps": 1, "norm": "1"}],
            "accepted.norm",
        ),
    ],
)
def test_round_fields_of_the_wrong_type_are_rejected_by_name(tmp_path, keys, keyring, field, value, says):
    theta = _tensors()
    kw = dict(outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "mean"}, accepted=[], rejected=[])
    path = rf.write_round(tmp_path, round=4, parent=3, theta=theta, momentum=theta, key=keys["agg"], **kw)
    _resign(path, keys["agg"], lambda doc: doc.update({field: value}))
    assert says in _rejected(path, keyring, lambda p, ring: rf.read_round(p, keyring=ring, aggregator="agg"))


def test_a_sites_copy_holds_theta_only_and_cannot_serve_as_outer_state(tmp_path, keys, keyring):
    theta = _tensors()
    kw = dict(outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "mean"}, accepted=[], rejected=[])
    (tmp_path / "full").mkdir()
    (tmp_path / "copy").mkdir()
    full = rf.write_round(tmp_path / "full", round=4, parent=3, theta=theta, momentum=theta, key=keys["agg"], **kw)
    copy = rf.write_round(tmp_path / "copy", round=4, parent=3, theta=theta, momentum=None, key=keys["agg"], **kw)
    got = rf.read_round(copy, keyring=keyring, aggregator="agg")
    assert got.momentum is None and set(got.theta) == set(theta)
    assert all(torch.equal(got.theta[k], theta[k]) for k in theta)
    size = lambda p: p.with_suffix(".safetensors").stat().st_size  # noqa: E731
    assert size(copy) < 0.55 * size(full)
    assert rf.read_round(full, keyring=keyring, aggregator="agg", need_momentum=True).momentum is not None
    with pytest.raises(rf.Rejected, match="θ only"):
        rf.read_round(copy, keyring=keyring, aggregator="agg", need_momentum=True)


def test_a_record_not_in_canonical_form_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    doc = json.loads(path.read_bytes())
    path.write_text(json.dumps(doc, indent=1))  # the same fields, the same valid signature, another spelling
    assert "not in canonical form" in _rejected(path, keyring)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"", "malformed JSON"),
        (b"{", "malformed JSON"),
        (b"\xff\xfe", "malformed JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"format_version": 1e999}', "malformed JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),
        (b'{"format_version": 1, "kind": "contribution"}', "unsigned"),
    ],
)
def test_malformed_json_is_rejected(tmp_path, keyring, text, says):
    path = tmp_path / "contrib-a-r000001.json"
    path.write_bytes(text)
    assert says in _rejected(path, keyring)


def test_a_json_over_1_mib_is_refused_before_reading(tmp_path, keyring):
    path = tmp_path / "contrib-a-r000001.json"
    with open(path, "wb") as f:
        f.truncate(rf.MAX_JSON_BYTES + 1)
    assert f"over the limit of {rf.MAX_JSON_BYTES}" in _rejected(path, keyring)


def test_a_payload_over_the_callers_limit_is_refused(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    assert "over the limit of 100" in _rejected(path, keyring, max_bytes=100)


def test_a_payload_whose_size_differs_from_the_record_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    with open(path.with_suffix(".safetensors"), "ab") as f:
        f.write(b"\0")
    assert "the record says" in _rejected(path, keyring)


def _header_payload(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"\1\2\3", "too short"),
        (struct.pack("<Q", 1 << 40) + b"{}", "payload header of 1099511627776 bytes, over the limit"),
        (struct.pack("<Q", 1000) + b"{}", "runs past the end"),
        (_header_payload(b"{not json"), "payload header is not valid JSON"),
        (_header_payload(b"[1]"), "payload header is not a JSON object"),
        (_header_payload(b"{}"), "missing ['w']"),
        (
            _header_payload(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{}}', bytes(8)),
            "not listed ['__metadata__']",
        ),
        (
            _header_payload(
                b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
                bytes(8),
            ),
            "duplicate key",
        ),
        (_header_payload(b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}', bytes(12)), "[3] in the payload"),
        (_header_payload(b'{"w":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}', bytes(8)), '"I32" [2]'),
        (_header_payload(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', bytes(8)), "do not hold"),
        (_header_payload(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', bytes(12)), "gap or overlap"),
        (_header_payload(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(9)), "data area is 9"),
        (_header_payload(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":"0-8"}}', bytes(8)), "data_offsets"),
        (_header_payload(b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,NaN]}}', bytes(8)), "not valid JSON"),
    ],
)
def test_a_signed_but_malicious_payload_header_is_rejected(tmp_path, keys, keyring, payload, says):
    """A key holder (a compromised site, a buggy writer) signs a payload whose safetensors header is hostile:
    refused by our own checks before the bytes reach the safetensors library."""
    path = _contrib(tmp_path, keys["a"], tensors={"w": torch.zeros(2)})
    _repayload(path, keys["a"], payload)
    assert says in _rejected(path, keyring)


def test_a_payload_with_other_tensors_than_the_record_lists_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"], tensors={"w": torch.zeros(2)})
    _repayload(path, keys["a"], safetensors.torch.save({"w": torch.zeros(2), "v": torch.zeros(1)}))
    assert "not listed ['v']" in _rejected(path, keyring)
    _repayload(path, keys["a"], safetensors.torch.save({"w": torch.zeros(2, dtype=torch.bfloat16)}))
    assert "BF16" in _rejected(path, keyring)


def test_compression_shrinks_int8_codes_and_changes_nothing_read(tmp_path, keys, keyring):
    """A Δ's int8 codes are far from uniform (most fall near the chunk's mean): zstd stores them in well under a
    byte each, and the contribution read back is the same either way."""
    from hpcscale.xsite.outer import encode

    g = torch.Generator().manual_seed(1)
    codes = encode({"w": torch.randn(256, 1024, generator=g) * 1e-3}, "int8")
    (tmp_path / "none").mkdir()
    (tmp_path / "zstd").mkdir()
    plain = _contrib(tmp_path / "none", keys["a"], encoding="int8", tensors=codes)
    packed = _contrib(tmp_path / "zstd", keys["a"], encoding="int8", tensors=codes, compression="zstd")
    size = lambda p: p.with_suffix(".safetensors").stat().st_size  # noqa: E731
    assert size(packed) < 0.95 * 256 * 1024 < size(plain)
    a, b = _read(plain, keyring), _read(packed, keyring)
    assert a.specs == b.specs and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def _zstd(data: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(**kw).compress(data)


_W = safetensors.torch.save({"w": torch.zeros(2)})  # a valid raw payload for a record listing w: F32 [2]


_V = safetensors.torch.save({"v": torch.zeros(2)})  # valid, but of another tensor than the record lists


@pytest.mark.parametrize(
    ("payload", "raw_bytes", "says"),
    [
        pytest.param(b"not zstd at all", len(_W), "not a zstd frame", id="not-zstd"),
        pytest.param(_zstd(_W, write_content_size=False), len(_W), "declares no size", id="no-size"),
        pytest.param(_zstd(_W), len(_W) + 1, f"declares {len(_W)} bytes, the record says {len(_W) + 1}", id="size"),
        pytest.param(_zstd(_W) + b"trailing", len(_W), "does not decompress", id="trailing"),
        pytest.param(_zstd(_W)[:-4], len(_W), "does not decompress", id="truncated"),
        pytest.param(_zstd(_W) + _zstd(_W), len(_W), "does not decompress", id="two-frames"),
        pytest.param(_zstd(_V), len(_V), "missing ['w']", id="other-tensor"),
        pytest.param(_zstd(b"x" * 100), 100, "payload header of", id="not-safetensors"),
    ],
)
def test_a_signed_but_malicious_compressed_payload_is_rejected(tmp_path, keys, keyring, payload, raw_bytes, says):
    """A key holder signs a compressed payload that lies about itself: refused with a reason, the frame's
    declared size checked against the signed one before anything is decompressed, the result then held to the
    same header checks as an uncompressed payload."""
    path = _contrib(tmp_path, keys["a"], tensors={"w": torch.zeros(2)}, compression="zstd")
    _repayload(path, keys["a"], payload, payload_raw_bytes=raw_bytes)
    assert says in _rejected(path, keyring)


def test_a_compression_bomb_is_refused_before_decompressing(tmp_path, keys, keyring):
    """1 GiB of zeros compresses to about 32 KiB: a record saying so is refused by the caller's bound on the raw
    size, and one that understates it by the frame's own header, both without allocating the gigabyte."""
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))  # 64 MiB here, the frame declares it
    path = _contrib(tmp_path, keys["a"], tensors={"w": torch.zeros(2)}, compression="zstd")
    _repayload(path, keys["a"], bomb, payload_raw_bytes=64 << 20)
    assert f"decompresses to {64 << 20} bytes, over the limit of {1 << 20}" in _rejected(
        path, keyring, max_bytes=1 << 20
    )
    _repayload(path, keys["a"], bomb, payload_raw_bytes=100)
    assert f"declares {64 << 20} bytes, the record says 100" in _rejected(path, keyring)
    # at the readers' default bound (16 GiB) too: no more than a safetensors file of the signed specs
    _repayload(path, keys["a"], bomb, payload_raw_bytes=64 << 20)
    assert f"decompresses to {64 << 20} bytes, but its tensors take 8:" in _rejected(path, keyring)


def test_the_aggregator_reads_a_contribution_within_its_models_size(tmp_path, keys, keyring):
    """A site's signed specs may list tensors far larger than the model (a compromised key): the aggregator's
    bound, the model's widest encoding, refuses their bomb before it is inflated."""
    from hpcscale.xsite.outer import contribution_bound, encoded_bytes

    model = {"w": (1000,)}
    assert contribution_bound(model) == 8 + rf.MAX_PAYLOAD_HEADER_BYTES + encoded_bytes(model, "fp32")
    assert contribution_bound(model) >= max(encoded_bytes(model, e) for e in ("fp32", "bf16", "int8"))
    fits = _contrib(tmp_path, keys["a"], tensors={"w": torch.ones(1000)}, compression="zstd")
    assert _read(fits, keyring, max_bytes=contribution_bound(model)).tensors["w"].shape == (1000,)
    huge = tmp_path / "huge"
    huge.mkdir()
    path = _contrib(huge, keys["a"], tensors={"w": torch.zeros(8 << 20)}, compression="zstd")  # 32 MiB listed
    assert "over the limit of" in _rejected(path, keyring, max_bytes=contribution_bound(model))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda doc: doc.update(payload_compression="gzip"), 'field \'payload_compression\': "gzip", expected "zstd"'),
        (lambda doc: doc.pop("payload_raw_bytes"), "missing ['payload_raw_bytes']"),
        (lambda doc: doc.pop("payload_compression"), "missing ['payload_compression']"),
        (lambda doc: doc.update(payload_raw_bytes=-1), "payload_raw_bytes"),
    ],
)
def test_compression_fields_come_as_a_valid_pair(tmp_path, keys, keyring, change, says):
    path = _contrib(tmp_path, keys["a"], compression="zstd")
    _resign(path, keys["a"], change)
    assert says in _rejected(path, keyring)


@pytest.mark.parametrize("which", [".json", ".safetensors"])
def test_a_symlinked_json_or_payload_is_refused(tmp_path, keys, keyring, which):
    real = tmp_path / "real"
    real.mkdir()
    path = _contrib(real, keys["a"])
    staged = tmp_path / "staged"
    staged.mkdir()
    for suffix in (".json", ".safetensors"):
        target = staged / path.with_suffix(suffix).name
        if suffix == which:
            target.symlink_to(path.with_suffix(suffix))
        else:
            target.write_bytes(path.with_suffix(suffix).read_bytes())
    assert "is a symlink" in _rejected(staged / path.name, keyring)


def test_a_fifo_payload_is_refused_without_blocking(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    payload = path.with_suffix(".safetensors")
    payload.unlink()
    os.mkfifo(payload)
    assert "not a regular file" in _rejected(path, keyring)


def test_a_missing_payload_is_rejected(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    path.with_suffix(".safetensors").unlink()
    assert "no such file" in _rejected(path, keyring)


# ---- writing ----


def test_a_written_record_is_never_overwritten(tmp_path, keys, keyring):
    path = _contrib(tmp_path, keys["a"])
    before = (path.read_bytes(), path.with_suffix(".safetensors").read_bytes())
    assert _contrib(tmp_path, keys["a"]) == path  # the same record again (a retried tick): fine, nothing changes
    with pytest.raises(RuntimeFailure, match="never overwritten"):
        _contrib(tmp_path, keys["a"], tensors={"w": torch.ones(2)})
    assert (path.read_bytes(), path.with_suffix(".safetensors").read_bytes()) == before
    theta = _tensors()
    kw = dict(outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "mean"}, accepted=[], rejected=[])
    rf.write_round(tmp_path, round=1, parent=0, theta=theta, momentum=theta, key=keys["agg"], **kw)
    with pytest.raises(RuntimeFailure, match="never overwritten"):
        rf.write_round(
            tmp_path,
            round=1,
            parent=0,
            theta=theta,
            momentum={n: t + 1 for n, t in theta.items()},
            key=keys["agg"],
            **kw,
        )


def test_an_orphan_payload_from_a_crashed_write_is_replaced(tmp_path, keys, keyring):
    (tmp_path / "contrib-a-r000003.safetensors").write_bytes(b"half a payload")
    path = _contrib(tmp_path, keys["a"])
    assert _read(path, keyring).tensors.keys() == _tensors().keys()


def test_a_planted_symlink_in_place_of_the_json_is_not_followed(tmp_path, keys):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / "contrib-a-r000003.json").symlink_to(victim)
    with pytest.raises(RuntimeFailure):
        _contrib(out, keys["a"])
    assert victim.read_text() == "keep"


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"site": "../x"}, "site"),
        ({"site": "a.1"}, "site"),
        ({"encoding": "fp8"}, "encoding"),
        ({"encoding": "fp32", "tensors": {"w": torch.zeros(2, dtype=torch.bfloat16)}}, "dtype"),
        ({"tensors": {"w": [1.0]}}, "not a tensor"),
        ({"tensors": {"a b": torch.zeros(1)}}, "invalid tensor name"),
        ({"base": -1}, "base_round"),
        ({"key": "not a key"}, "ed25519"),
    ],
)
def test_the_writer_refuses_what_a_reader_would_reject(tmp_path, keys, kw, says):
    kw = dict(kw)
    key = kw.pop("key", keys["a"])
    with pytest.raises(BadInput, match=says):
        _contrib(tmp_path, key, **kw)
    assert not list(tmp_path.iterdir())


def test_the_writer_refuses_an_inconsistent_round(tmp_path, keys):
    theta = _tensors()
    kw = dict(outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "mean"}, accepted=[], rejected=[])
    with pytest.raises(BadInput, match="same names"):
        rf.write_round(tmp_path, round=1, parent=0, theta=theta, momentum={}, key=keys["agg"], **kw)
    with pytest.raises(BadInput, match="parent"):
        rf.write_round(tmp_path, round=1, parent=5, theta=theta, momentum=theta, key=keys["agg"], **kw)
    with pytest.raises(BadInput, match="dtype"):
        half = {n: t.half() for n, t in theta.items()}
        rf.write_round(tmp_path, round=1, parent=0, theta=half, momentum=half, key=keys["agg"], **kw)
    with pytest.raises(BadInput, match="pairs"):
        rf.write_round(tmp_path, round=1, parent=0, theta={"w": torch.zeros(2)}, momentum={"w": torch.zeros(3)},
                       key=keys["agg"], **kw)  # fmt: skip
    assert not list(tmp_path.iterdir())


# ---- round numbers: what a partner's record may name is bounded ---------------------------------------------------

_ROUND_NUMBERS = st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(
    [0, rf.MAX_ROUND, rf.MAX_ROUND + 1, 2**63 - 1, 2**63, -1]
)


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=_ROUND_NUMBERS)
def test_a_contributions_base_round_is_a_round_number_six_digits_can_name(tmp_path_factory, keys, keyring, n):
    """Signed by a partner's own key, a base round is read only from 0 to 999999: what a record's file name can
    spell. Any other number (or a bool, a float) is refused naming the field, never a traceback."""
    d = tmp_path_factory.mktemp("base")
    path = _contrib(d, keys["a"])
    _resign(path, keys["a"], lambda doc: doc.update(base_round=n))
    if 0 <= n <= rf.MAX_ROUND:
        named = path.with_name(f"contrib-a-r{n:06d}.json")
        path.with_suffix(".safetensors").rename(named.with_suffix(".safetensors"))
        path.rename(named)
        assert _read(named, keyring).base_round == n
    else:
        assert "field 'base_round': expected a round number from 0 to 999999" in _rejected(path, keyring)


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=_ROUND_NUMBERS, where=st.sampled_from(["round", "accepted.base_round", "rejected.base_round"]))
def test_a_rounds_numbers_are_round_numbers_six_digits_can_name(tmp_path_factory, keys, keyring, n, where):
    d = tmp_path_factory.mktemp("round")
    theta = _tensors()
    entry = {"site": "a", "payload_sha256": "0" * 64, "tokens": 1, "steps": 1, "base_round": 3}
    path = rf.write_round(d, round=4, parent=3, outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "rule": "m"},
                          accepted=[entry], rejected=[{"site": "b", "reason": "r", "base_round": 3}], theta=theta,
                          momentum=theta, key=keys["agg"])  # fmt: skip

    def change(doc):
        if where == "round":
            doc.update(round=n, parent=None if n == 0 else n - 1 if type(n) is int else n)
        else:
            doc[where.split(".")[0]][0]["base_round"] = n

    _resign(path, keys["agg"], change)
    read = lambda p, ring: rf.read_round(p, keyring=ring, aggregator="agg")  # noqa: E731
    if 0 <= n <= rf.MAX_ROUND:
        named = path.with_name(f"round-{n:06d}.json") if where == "round" else path
        if named != path:
            path.with_suffix(".safetensors").rename(named.with_suffix(".safetensors"))
            path.rename(named)
        assert read(named, keyring) is not None
    else:
        assert f"field '{where}': expected a round number from 0 to 999999" in _rejected(path, keyring, read)


# ---- fuzzing: anything from outside is Rejected, never another exception, quickly ----


@pytest.fixture(scope="module", params=["none", "zstd", "bound"])
def valid_pair(tmp_path_factory, keys, request) -> tuple[bytes, bytes]:
    """A valid contribution: uncompressed, compressed, and bound to a training and its base weights."""
    d = tmp_path_factory.mktemp("valid")
    path = _contrib(d, keys["a"], compression="none" if request.param == "bound" else request.param,
                    bound=request.param == "bound")  # fmt: skip
    return path.read_bytes(), path.with_suffix(".safetensors").read_bytes()


def _read_pair(json_bytes: bytes, payload: bytes, keyring) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "contrib-a-r000003.json"
        path.write_bytes(json_bytes)
        path.with_suffix(".safetensors").write_bytes(payload)
        t0 = time.process_time()
        with pytest.raises(rf.Rejected):
            _read(path, keyring, expected_base_round=3)
        assert time.process_time() - t0 < QUICK


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096) | st.text(max_size=2048).map(str.encode))
def test_arbitrary_bytes_as_the_record_are_rejected(keyring, valid_pair, data):
    _read_pair(data, valid_pair[1], keyring)


_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(min_value=0), st.integers(min_value=1, max_value=255)),
    st.tuples(st.just("truncate"), st.integers(min_value=0)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("insert"), st.integers(min_value=0), st.binary(min_size=1, max_size=8)),
)


def _mutate(data: bytes, mutation) -> bytes:
    op = mutation[0]
    if op == "flip":
        if not data:
            return b"\x00"
        i = mutation[1] % len(data)
        return data[:i] + bytes([data[i] ^ mutation[2]]) + data[i + 1 :]
    if op == "truncate":
        return data[: mutation[1] % max(len(data), 1)]
    if op == "append":
        return data + mutation[1]
    i = mutation[1] % (len(data) + 1)
    return data[:i] + mutation[2] + data[i:]


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["json", "payload", "both"]), mutations=st.lists(_MUTATION, min_size=1, max_size=3))
def test_any_mutation_of_a_valid_pair_is_rejected(keyring, valid_pair, target, mutations):
    json_bytes, payload = valid_pair
    for m in mutations:
        if target in ("json", "both"):
            json_bytes = _mutate(json_bytes, m)
        if target in ("payload", "both"):
            payload = _mutate(payload, m)
    assume((json_bytes, payload) != valid_pair)  # two flips of one byte undo each other
    _read_pair(json_bytes, payload, keyring)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    field=st.sampled_from(
        sorted((rf.CONTRIBUTION_FIELDS | COMPRESSED_FIELDS | rf.CONTRIBUTION_BINDING) - {"signature", "key_id"})
    ),
    value=_JSON,
)
def test_any_field_value_signed_by_the_right_key_is_read_or_rejected(keys, keyring, valid_pair, field, value):
    """Field checks against hostile values from a key holder: a clean Rejected, or (when the value happens to be
    valid) a contribution; never another exception."""
    doc = json.loads(valid_pair[0])
    del doc["signature"]
    doc[field] = value
    doc["signature"] = signing.sign(keys["a"], rf.canonical_json(doc))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "contrib-a-r000003.json"
        path.write_bytes(rf.canonical_json(doc) + b"\n")
        path.with_suffix(".safetensors").write_bytes(valid_pair[1])
        t0 = time.process_time()
        try:
            _read(path, keyring)
        except rf.Rejected as e:
            assert e.reason
        assert time.process_time() - t0 < QUICK


@settings(deadline=None, max_examples=200)
@given(signature=_JSON, data=st.binary(max_size=64))
def test_verify_never_raises(keyring, signature, data):
    assert signing.verify(keyring["a"][0], data, signature) is False


# ---- keys ----


def test_keys_are_created_exclusively_with_mode_0600(tmp_path):
    old = os.umask(0)
    try:
        files = signing.generate_key(tmp_path, "siteA")
    finally:
        os.umask(old)
    private, public = files
    assert (private, public) == (tmp_path / "siteA.key", tmp_path / "siteA.pub")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    text = private.read_bytes()
    with pytest.raises(BadInput, match="never overwritten"):
        signing.generate_key(tmp_path, "siteA")
    assert private.read_bytes() == text
    public.unlink()  # only the private key is left: still refused (O_EXCL), and it stays as it was
    with pytest.raises(BadInput, match="never overwritten"):
        signing.generate_key(tmp_path, "siteA")
    assert private.read_bytes() == text and not public.exists()


def test_a_planted_symlink_is_not_followed_when_creating_a_key(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "s.key").symlink_to(victim)
    with pytest.raises(BadInput):
        signing.generate_key(tmp_path, "s")
    assert victim.read_text() == "keep" and not (tmp_path / "s.pub").exists()


def test_a_private_key_others_can_read_is_refused(tmp_path):
    private, _ = signing.generate_key(tmp_path, "s")
    private.chmod(0o640)
    with pytest.raises(BadInput, match="readable by its owner only"):
        signing.load_private(private)


def test_key_files_that_are_not_keys_are_bad_input(tmp_path):
    (tmp_path / "x.pub").write_text("not a key")
    with pytest.raises(BadInput, match="not a PEM public key"):
        signing.load_public(tmp_path / "x.pub")
    with pytest.raises(BadInput, match="not a PEM public key"):
        signing.load_keyring(tmp_path)
    (tmp_path / "y.key").write_bytes(b"\0" * 10_000)
    with pytest.raises(BadInput, match="over the limit"):
        signing.load_private(tmp_path / "y.key")
    with pytest.raises(BadInput, match="no such keyring"):
        signing.load_keyring(tmp_path / "nope")


def test_the_keyring_skips_names_that_are_not_site_keys(tmp_path, keydir):
    pem = (keydir / "a.pub").read_bytes()
    (tmp_path / "a.pub").write_bytes(pem)
    (tmp_path / "a.2.pub").write_bytes((keydir / "b.pub").read_bytes())
    for junk in ("README", "a.pub.bak", ".hidden.pub", "-x.pub", "sp ace.pub", "a.key", "a.1234567.pub", "é.pub"):
        (tmp_path / junk).write_text("junk")
    ring = signing.load_keyring(tmp_path)
    assert list(ring) == ["a"] and len(ring["a"]) == 2


@pytest.mark.parametrize("name", ["a", "site-1", "jülich", "a.b", "A_b-c.d", "x" * 64])
def test_site_names(name):
    ok = name in ("a", "site-1", "a.b", "A_b-c.d", "x" * 64)
    assert signing.valid_site_name(name) is ok
    assert signing.valid_site_name(name + ".1") is False  # would read as key generation 1
    assert signing.valid_site_name("x" * 65) is False


def test_rotation_an_old_listed_key_is_accepted_a_removed_one_is_rejected(tmp_path):
    keydir, out = tmp_path / "keys", tmp_path / "out"
    keydir.mkdir()
    out.mkdir()
    old = signing.load_private(signing.generate_key(keydir, "a").private)
    new_files = signing.generate_key(keydir, "a", generation=2)
    assert new_files.public.name == "a.2.pub"
    new = signing.load_private(new_files.private)
    ring = signing.load_keyring(keydir)
    assert len(ring["a"]) == 2
    by_old = _contrib(out, old, base=1)
    by_new = _contrib(out, new, base=2)
    assert _read(by_old, ring).key_id == signing.key_id(old.public_key())  # during the overlap: both accepted
    assert _read(by_new, ring).key_id == signing.key_id(new.public_key())
    (keydir / "a.pub").unlink()  # the old key is retired from the keyring
    ring = signing.load_keyring(keydir)
    assert "which the keyring does not list for site 'a'" in _rejected(by_old, ring)
    assert _read(by_new, ring).base_round == 2


def test_a_bound_contribution_reads_back_its_training_and_base_digest(tmp_path, keys, keyring):
    c = _read(_contrib(tmp_path, keys["a"], bound=True), keyring)
    assert c.training == "fmt:" + "ab" * 16 and c.base_theta_sha256 == rf.theta_digest(_tensors())
    (tmp_path / "u").mkdir()
    assert _read(_contrib(tmp_path / "u", keys["a"]), keyring).training is None  # written before binding: None


@pytest.mark.parametrize(
    ("binding", "says"),
    [
        ({"training": "fmt:" + "ab" * 16}, "fields differ"),  # half a binding
        ({"training": "no colon", "base_theta_sha256": "0" * 64}, "field 'training'"),
        ({"training": "fmt:" + "ab" * 16, "base_theta_sha256": "XYZ"}, "field 'base_theta_sha256'"),
    ],
)
def test_a_malformed_binding_is_rejected_by_name(tmp_path, keys, keyring, binding, says):
    path = _contrib(tmp_path, keys["a"])
    doc = json.loads(path.read_text())
    del doc["signature"]
    doc.update(binding)
    doc["signature"] = signing.sign(keys["a"], rf.canonical_json(doc))
    path.write_bytes(rf.canonical_json(doc) + b"\n")
    with pytest.raises(rf.Rejected) as e:
        _read(path, keyring)
    assert says in e.value.reason


def test_theta_digest_names_the_weights_not_the_dict():
    t = _tensors()
    assert rf.theta_digest(t) == rf.theta_digest(dict(reversed(list(t.items()))))
    assert rf.theta_digest(t) != rf.theta_digest({k: v + 1e-7 for k, v in t.items()})
    assert rf.theta_digest(t) != rf.theta_digest({k: v.reshape(-1) for k, v in t.items()})

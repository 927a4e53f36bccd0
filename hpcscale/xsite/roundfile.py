"""Signed record files for cross-site rounds: a site's contribution and the aggregator's published round.

A record is a pair `<stem>.safetensors` (tensors) + `<stem>.json` (everything else, and the signature); see
docs/cross-site-format.md for every field. Everything read here came from another site, so:

- a reader trusts nothing before the signature has been checked, and nothing in the payload before its sha256
  has been checked against the signed record; tensors are returned only after every check has passed;
- every failure is one exception, `Rejected`, whose `reason` says what was wrong (exit 3 in the CLI); any other
  exception escaping a reader is a bug;
- every read is bounded before it is parsed: the JSON by MAX_JSON_BYTES, the payload by the caller's
  `max_bytes`, the payload's safetensors header by MAX_PAYLOAD_HEADER_BYTES (checked here before the bytes reach
  the safetensors library, whose own limit is 100 MB), entries, names and shapes by the constants below;
- neither file is opened through a symlink (O_NOFOLLOW), and only regular files are read (O_NONBLOCK: a FIFO
  planted in a staging directory cannot block a tick);
- the JSON text must be exactly canonical_json(fields) plus a newline, so a record has one spelling and no byte
  of it can change without the signature failing;
- a compressed payload (`payload_compression: zstd`) reaches the decompressor only after its sha256 has been
  checked, and only when its frame declares exactly the signed `payload_raw_bytes`, itself within `max_bytes` and
  no larger than a safetensors file of the signed tensor specs can be: a small file cannot make a reader
  allocate more than the caller allowed, or more than the tensors it lists need.

Commit order when writing (where a crash may land): the payload goes to a temporary name, is fsynced and
renamed to `<stem>.safetensors`; then the JSON goes to a temporary name, is fsynced and hard-linked to
`<stem>.json` (link, not rename: it fails instead of replacing a record that appeared meanwhile); then the
directory is fsynced. A crash before the link leaves at most a payload without its JSON, which no reader
considers and the next write of that stem replaces; the presence of `<stem>.json` means the pair is complete.
A stem whose JSON exists is never written again: the same record (all fields but `created` and `signature`) is
accepted as already written, a different one is an error. One writer per stem is assumed (a site writes its
own contributions, the aggregator its rounds under its lock).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from hpcscale.errors import BadInput, RuntimeFailure, VerificationFailure
from hpcscale.portable import files
from hpcscale.util.bounded import file_problem, loads_json
from hpcscale.xsite.signing import Keyring, key_id, sign, valid_site_name, verify

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
MiB = 1 << 20
MAX_JSON_BYTES = 1 * MiB
MAX_PAYLOAD_HEADER_BYTES = 16 * MiB
DEFAULT_MAX_PAYLOAD_BYTES = 16 << 30  # callers should pass a bound from their model's size
MAX_TENSORS = 100_000
MAX_DIMS = 16
MAX_DIM = 1 << 48
MAX_INT = (1 << 63) - 1
MAX_ROUND = 999_999  # round numbers: six digits in every record's file name (round-NNNNNN, contrib-S-rNNNNNN)
MAX_LISTED_SITES = 10_000  # entries in a round's accepted and rejected lists
MAX_REASON_CHARS = 4096
FP32_MAX = 3.4028234663852886e38  # a norm stored in a round: any finite fp32 value

# safetensors dtype -> (torch's name for it, bytes per element). Only what the formats use. Names, not torch
# dtypes: torch is imported where tensors are handled, not here (an idle `hpcscale sync` tick needs none of it).
DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "I8": ("int8", 1), "U8": ("uint8", 1)}
_DTYPE_NAMES = {f"torch.{attr}": name for name, (attr, _) in DTYPES.items()}  # str(torch dtype) -> stored name
# F32 beside bf16 and int8: tensors kept at full precision, and int8's offsets and steps (its codes are I8 or U8).
ENCODINGS = {
    "fp32": frozenset({"F32"}),
    "bf16": frozenset({"BF16", "F32"}),
    "int8": frozenset({"I8", "U8", "F32"}),
}
TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,511}")  # and not "__…": safetensors reserves it
_RULE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_PRINTABLE = re.compile(r"[\x20-\x7e]{1,256}")
_CREATED = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?[+-][0-9]{2}:[0-9]{2}")

_COMMON = ("format_version", "kind", "tensors", "payload_sha256", "payload_bytes", "created", "key_id")
# Optional, both or neither: the payload file is one zstd frame of the safetensors bytes (payload_raw_bytes long).
COMPRESSION_FIELDS = frozenset({"payload_compression", "payload_raw_bytes"})
COMPRESSIONS = ("none", "zstd")
ZSTD_LEVEL = 1  # the same size as levels 3 and 9 on Δ (Δ is close to noise), and faster both ways
MAX_ZSTD_WINDOW = 1 << 27  # refuse frames that would need more decoder memory than zstd's own default limit
CONTRIBUTION_FIELDS = frozenset((*_COMMON, "signature", "site", "base_round", "steps", "tokens", "encoding"))
ROUND_FIELDS = frozenset((*_COMMON, "signature", "round", "parent", "outer", "accepted", "rejected"))
# What binds a record to one cross-site training and to the exact weights it builds on (all of a kind's, or none:
# records written before them): `training` ("<config name>:<32 hex>", fixed at round 0 from the config's name and
# θ(0)'s digest) in rounds and contributions, and a contribution's `base_theta_sha256` (theta_digest of θ(base)).
CONTRIBUTION_BINDING = frozenset({"training", "base_theta_sha256"})
ROUND_BINDING = frozenset({"training"})
_TRAINING = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}:[0-9a-f]{32}")
THETA, MOMENTUM = "theta/", "momentum/"
_OUTER_KEYS = frozenset({"lr", "momentum", "nesterov", "rule", "encoding"})


class Rejected(VerificationFailure):
    """A record that must not be applied; `reason` says why (the message adds the file)."""

    def __init__(self, reason: str, path: str | Path | None = None):
        self.reason = reason
        self.path = None if path is None else Path(path)
        super().__init__(f"{path}: rejected: {reason}" if path is not None else f"rejected: {reason}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # as stored, in safetensors' spelling: F32, BF16, I8, U8

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype][0])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Contribution:
    path: Path  # the .json
    site: str
    base_round: int  # the published round whose θ this Δ was computed against; it is for round base_round + 1
    steps: int
    tokens: int
    encoding: str  # fp32 | bf16 | int8
    created: str
    payload_sha256: str
    key_id: str
    specs: dict[str, TensorSpec]  # name -> shape and dtype, as stored
    tensors: dict[str, torch.Tensor]  # the same names, verified against specs
    training: str | None = None  # the cross-site training it belongs to (None: written before records named it)
    base_theta_sha256: str | None = None  # theta_digest of the θ(base) this Δ was computed against

    @property
    def round(self) -> int:
        return self.base_round + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterStepRecord:
    """The outer step a round record says was taken (its parameters and rule), not the optimizer itself
    (hpcscale.xsite.outer.OuterStep)."""

    lr: float
    momentum: float
    nesterov: bool
    rule: str  # how contributions were combined, e.g. "mean"
    encoding: str | None = None  # optional: the encoding sites are asked to use for their next contributions


@dataclass(frozen=True, slots=True, kw_only=True)
class AcceptedContribution:
    site: str
    payload_sha256: str
    tokens: int
    steps: int
    base_round: int | None = None  # the round its Δ was computed against (older than parent: folded in late)
    norm: float | None = None  # ‖Δ‖ as decoded: later rounds bound new contributions by recent ones (outer.screen)


@dataclass(frozen=True, slots=True, kw_only=True)
class RejectedContribution:
    site: str
    reason: str
    base_round: int | None = None  # the base of the contribution refused, where known: never tried again


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedRound:
    path: Path  # the .json
    aggregator: str  # whose key signed it (read_round's argument; a round names no site itself)
    round: int
    parent: int | None  # round - 1; None for round 0, the initial weights
    outer: OuterStepRecord
    accepted: tuple[AcceptedContribution, ...]
    rejected: tuple[RejectedContribution, ...]
    created: str
    payload_sha256: str
    key_id: str
    specs: dict[str, TensorSpec]  # as stored: theta/<name> and momentum/<name> (or theta/<name> only)
    theta: dict[str, torch.Tensor]  # <name> -> fp32
    momentum: dict[str, torch.Tensor] | None  # <name> -> fp32, same shapes; None in a site's copy (θ only)
    training: str | None = None  # the cross-site training it belongs to (None: written before records named it)


def canonical_json(fields: Mapping[str, Any]) -> bytes:
    """The one spelling of a record: sorted keys, no whitespace, ASCII only (others as \\uXXXX)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def contribution_stem(site: str, base_round: int) -> str:
    """Named for the round it starts from: contrib-S-r000004 is Δ against round-000004, for round 5."""
    return f"contrib-{site}-r{base_round:06d}"


def round_stem(round: int) -> str:
    return f"round-{round:06d}"


# ---- field checks: each raises Rejected naming the field ----


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=True) if isinstance(value, str | int | float | bool | None) else None
    text = text if text is not None else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: object, field: str, minimum: int = 0) -> int:
    if type(value) is not int or not minimum <= value <= MAX_INT:
        raise Rejected(f"field '{field}': expected an integer from {minimum} to 2^63-1, got {_show(value)}")
    return value


def _round_number(value: object, field: str) -> int:
    """A round number: what a record's file name can spell (six digits), so no record names one that none can."""
    if type(value) is not int or not 0 <= value <= MAX_ROUND:
        raise Rejected(f"field '{field}': expected a round number from 0 to {MAX_ROUND}, got {_show(value)}")
    return value


def _float(value: object, field: str, lo: float, hi: float) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise Rejected(f"field '{field}': expected a number from {lo} to {hi}, got {_show(value)}")
    return float(value)


def _text(value: object, field: str, pattern: re.Pattern[str], expected: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise Rejected(f"field '{field}': expected {expected}, got {_show(value)}")
    return value


def _site(value: object, field: str) -> str:
    if not valid_site_name(value):
        raise Rejected(f"field '{field}': not a valid site name: {_show(value)}")
    return value  # type: ignore[return-value]


def _created(value: object) -> str:
    try:  # the pattern first: what fromisoformat accepts differs between Python versions
        if isinstance(value, str) and _CREATED.fullmatch(value) and datetime.fromisoformat(value):
            return value
    except ValueError:
        pass
    raise Rejected(f"field 'created': expected an ISO 8601 time with a UTC offset, got {_show(value)}")


def _specs(value: object, allowed_dtypes: frozenset[str]) -> dict[str, TensorSpec]:
    if not isinstance(value, dict):
        raise Rejected(f"field 'tensors': expected an object, got {_show(value)}")
    if len(value) > MAX_TENSORS:
        raise Rejected(f"field 'tensors': {len(value)} entries, over the limit of {MAX_TENSORS}")
    specs = {}
    for name, entry in value.items():
        if not TENSOR_NAME.fullmatch(name) or name.startswith("__"):
            raise Rejected(f"field 'tensors': invalid tensor name {_show(name)}")
        where = f"tensors.{name}"
        if not isinstance(entry, dict) or set(entry) != {"shape", "dtype"}:
            raise Rejected(f"field '{where}': expected an object with exactly 'shape' and 'dtype'")
        dtype, shape = entry["dtype"], entry["shape"]
        if not isinstance(dtype, str) or dtype not in allowed_dtypes:
            raise Rejected(
                f"field '{where}.dtype': {_show(dtype)}, expected one of {', '.join(sorted(allowed_dtypes))}"
            )
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise Rejected(f"field '{where}.shape': expected a list of at most {MAX_DIMS} sizes")
        dims = tuple(_int(d, f"{where}.shape", 0) for d in shape)
        if any(d > MAX_DIM for d in dims) or math.prod(dims) > MAX_INT // 8:
            raise Rejected(f"field '{where}.shape': {list(dims)} is too large")
        specs[name] = TensorSpec(shape=dims, dtype=dtype)
    return specs


def _outer(value: object) -> OuterStepRecord:
    if not isinstance(value, dict) or not {"lr", "momentum", "nesterov", "rule"} <= set(value) <= _OUTER_KEYS:
        raise Rejected("field 'outer': expected an object with lr, momentum, nesterov, rule (and maybe encoding)")
    if type(value["nesterov"]) is not bool:
        raise Rejected(f"field 'outer.nesterov': expected true or false, got {_show(value['nesterov'])}")
    encoding = value.get("encoding")
    if encoding is not None and (not isinstance(encoding, str) or encoding not in ENCODINGS):
        raise Rejected(f"field 'outer.encoding': {_show(encoding)}, expected one of {', '.join(ENCODINGS)}")
    return OuterStepRecord(
        encoding=encoding,
        lr=_float(value["lr"], "outer.lr", 0.0, 1e6),
        momentum=_float(value["momentum"], "outer.momentum", 0.0, 1.0),
        nesterov=value["nesterov"],
        rule=_text(value["rule"], "outer.rule", _RULE, "1-64 of A-Z a-z 0-9 _ . : -"),
    )


def _list(value: object, field: str, keys: set[str], optional: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) > MAX_LISTED_SITES:
        raise Rejected(f"field '{field}': expected a list of at most {MAX_LISTED_SITES} entries")
    for item in value:
        if not isinstance(item, dict) or not keys <= set(item) <= keys | optional:
            also = f" (and maybe {', '.join(sorted(optional))})" if optional else ""
            raise Rejected(f"field '{field}': expected objects with exactly {', '.join(sorted(keys))}{also}")
    return value  # type: ignore[return-value]


def _parse_fields(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    """Every field of a record checked and converted; format_version and kind were checked by the caller."""
    out: dict[str, Any] = {
        "payload_sha256": _text(doc["payload_sha256"], "payload_sha256", _SHA256, "64 lowercase hex digits"),
        "payload_bytes": _int(doc["payload_bytes"], "payload_bytes"),
        "created": _created(doc["created"]),
        "key_id": _text(doc["key_id"], "key_id", _KEY_ID, "16 lowercase hex digits"),
        "compression": "none",
    }
    out["training"] = (
        _text(doc["training"], "training", _TRAINING, "<name>:<32 hex digits>") if "training" in doc else None
    )
    if "base_theta_sha256" in doc:
        out["base_theta_sha256"] = _text(doc["base_theta_sha256"], "base_theta_sha256", _SHA256, "a sha256")
    else:
        out["base_theta_sha256"] = None
    if "payload_compression" in doc:
        if doc["payload_compression"] != "zstd":
            raise Rejected(f"field 'payload_compression': {_show(doc['payload_compression'])}, expected \"zstd\"")
        out.update(compression="zstd", raw_bytes=_int(doc["payload_raw_bytes"], "payload_raw_bytes"))
    if kind == "contribution":
        encoding = doc["encoding"]
        if not isinstance(encoding, str) or encoding not in ENCODINGS:
            raise Rejected(f"field 'encoding': {_show(encoding)}, expected one of {', '.join(ENCODINGS)}")
        site = _site(doc["site"], "site")
        base_round = _round_number(doc["base_round"], "base_round")
        out.update(
            site=site,
            base_round=base_round,
            steps=_int(doc["steps"], "steps"),
            tokens=_int(doc["tokens"], "tokens"),
            encoding=encoding,
            specs=_specs(doc["tensors"], ENCODINGS[encoding]),
            stem=contribution_stem(site, base_round),
        )
        return out
    round_ = _round_number(doc["round"], "round")
    parent = doc["parent"]
    if round_ == 0 and parent is not None:
        raise Rejected(f"field 'parent': {_show(parent)}, but round 0 has none (null)")
    if round_ > 0 and (type(parent) is not int or parent != round_ - 1):
        raise Rejected(f"field 'parent': {_show(parent)}, but round {round_} follows round {round_ - 1}")
    specs = _specs(doc["tensors"], frozenset({"F32"}))
    theta = {n[len(THETA) :]: s for n, s in specs.items() if n.startswith(THETA)}
    momentum = {n[len(MOMENTUM) :]: s for n, s in specs.items() if n.startswith(MOMENTUM)}
    if (
        not theta
        or len(theta) + len(momentum) != len(specs)
        or (momentum and theta != momentum)
        or not all(map(TENSOR_NAME.fullmatch, theta))
    ):
        raise Rejected(
            "field 'tensors': expected theta/<name> and momentum/<name> pairs of the same shape, or theta/<name> "
            "only (a site's copy)"
        )
    out.update(
        round=round_,
        parent=parent,
        outer=_outer(doc["outer"]),
        accepted=tuple(
            AcceptedContribution(
                site=_site(a["site"], "accepted.site"),
                payload_sha256=_text(a["payload_sha256"], "accepted.payload_sha256", _SHA256, "a sha256"),
                tokens=_int(a["tokens"], "accepted.tokens"),
                steps=_int(a["steps"], "accepted.steps"),
                base_round=_round_number(a["base_round"], "accepted.base_round") if "base_round" in a else None,
                norm=_float(a["norm"], "accepted.norm", 0.0, FP32_MAX) if "norm" in a else None,
            )
            for a in _list(
                doc["accepted"],
                "accepted",
                {"site", "payload_sha256", "tokens", "steps"},
                frozenset({"base_round", "norm"}),
            )
        ),
        rejected=tuple(
            RejectedContribution(
                site=_text(r["site"], "rejected.site", _PRINTABLE, "1-256 printable ASCII characters"),
                reason=_reason(r["reason"]),
                base_round=_round_number(r["base_round"], "rejected.base_round") if "base_round" in r else None,
            )
            for r in _list(doc["rejected"], "rejected", {"site", "reason"}, frozenset({"base_round"}))
        ),
        specs=specs,
        stem=round_stem(round_),
    )
    return out


def _reason(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REASON_CHARS:
        raise Rejected(f"field 'rejected.reason': expected text of 1-{MAX_REASON_CHARS} characters")
    return value


# ---- reading ----


def _read_regular(path: Path, *, max_bytes: int, what: str, expected_size: int | None = None) -> bytes:
    """The bytes of a regular file, never through a symlink, refused before reading when too large."""

    def size_as_recorded(st: os.stat_result) -> None:  # before a byte is read
        if expected_size is not None and st.st_size != expected_size:
            raise Rejected(f"{what} {path.name}: {st.st_size} bytes, the record says {expected_size}")

    try:
        data, st = files.read_regular(path, max_bytes=max_bytes, follow_symlinks=False, check=size_as_recorded)
    except OSError as e:
        raise Rejected(f"{what} {path.name}: {file_problem(e)}") from None
    if len(data) != st.st_size:
        raise Rejected(f"{what} {path.name} changed while it was read")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _payload_tensors(data: bytes, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose header lists exactly `specs`, checked before the library sees
    the bytes: header size, JSON, names, dtypes, shapes, and data offsets that tile the data area exactly."""
    if len(data) < 8:
        raise Rejected(f"payload of {len(data)} bytes is too short for a safetensors file")
    size = int.from_bytes(data[:8], "little")
    if size > MAX_PAYLOAD_HEADER_BYTES:
        raise Rejected(f"payload header of {size} bytes, over the limit of {MAX_PAYLOAD_HEADER_BYTES}")
    if 8 + size > len(data):
        raise Rejected(f"payload header of {size} bytes runs past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(
            data[8 : 8 + size].decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant
        )
    except (ValueError, RecursionError) as e:
        raise Rejected(f"payload header is not valid JSON ({str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise Rejected("payload header is not a JSON object")
    missing, extra = sorted(set(specs) - set(header)), sorted(set(header) - set(specs))
    if missing or extra:
        raise Rejected(f"payload tensors differ from the record: missing {missing[:5]}, not listed {extra[:5]}")
    spans = []
    for name, spec in specs.items():
        entry = header[name]
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise Rejected(f"payload tensor {name}: malformed header entry")
        if entry["dtype"] != spec.dtype or entry["shape"] != list(spec.shape):
            raise Rejected(
                f"payload tensor {name}: {_show(entry['dtype'])} {_show_shape(entry['shape'])} in the payload, "
                f"{spec.dtype} {list(spec.shape)} in the record"
            )
        offsets = entry["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise Rejected(f"payload tensor {name}: malformed data_offsets")
        begin, end = offsets
        if end - begin != spec.nbytes:
            raise Rejected(f"payload tensor {name}: data_offsets {offsets} do not hold its shape and dtype")
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise Rejected(f"payload tensor {name}: data_offsets {[begin, end]} leave a gap or overlap")
        position = end
    if position != len(data) - 8 - size:
        raise Rejected(f"payload data area is {len(data) - 8 - size} bytes, its tensors cover {position}")
    import safetensors.torch

    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # the library's own checks, after ours; any failure means the payload is bad
        raise Rejected(f"payload cannot be loaded ({str(e)[:200]})") from None
    if set(tensors) != set(specs):
        raise Rejected("payload loaded with other tensors than its header lists")
    for name, spec in specs.items():  # what the library built must be what was checked
        t = tensors[name]
        if t.dtype != spec.torch_dtype or tuple(t.shape) != spec.shape:
            raise Rejected(f"payload tensor {name}: loaded differently from its header")
    return tensors


def _show_shape(shape: object) -> str:
    return str(shape)[:60] if isinstance(shape, list) else _show(shape)


def _read_record(json_path: Path, kind: str) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """Checks 1-5 of docs/cross-site-format.md ("What a reader checks"): the text, the document and its fields."""
    text = _read_regular(json_path, max_bytes=MAX_JSON_BYTES, what="record")
    try:
        doc = loads_json(text, source="record", max_bytes=MAX_JSON_BYTES)
    except BadInput as e:
        raise Rejected(f"malformed JSON ({e})") from None
    if not isinstance(doc, dict):
        raise Rejected("not a JSON object")
    version = doc.get("format_version")
    if version != FORMAT_VERSION or type(version) is not int:
        raise Rejected(f"unknown format version {_show(version)} (this reader knows {FORMAT_VERSION})")
    if doc.get("kind") != kind:
        raise Rejected(f"kind {_show(doc.get('kind'))}, expected {_show(kind)}")
    if doc.get("signature") in ("", None):
        raise Rejected("unsigned: no signature")
    expected = CONTRIBUTION_FIELDS if kind == "contribution" else ROUND_FIELDS
    if COMPRESSION_FIELDS & set(doc):
        expected = expected | COMPRESSION_FIELDS
    binding = CONTRIBUTION_BINDING if kind == "contribution" else ROUND_BINDING
    if binding & set(doc):
        expected = expected | binding
    if set(doc) != expected:
        missing, unknown = sorted(expected - set(doc)), sorted(set(doc) - expected)
        raise Rejected(f"fields differ from format {FORMAT_VERSION}: missing {missing}, unknown {unknown[:5]}")
    return text, doc, _parse_fields(doc, kind)


def _check_signed(
    json_path: Path, text: bytes, doc: dict[str, Any], fields: dict[str, Any], signer: str, keyring: Keyring
) -> None:
    """Checks 7-9: the file name, the signature by one of `signer`'s listed keys, the canonical spelling."""
    if json_path.name != fields["stem"] + ".json":
        raise Rejected(f"file name {json_path.name!r} does not match the record: expected '{fields['stem']}.json'")
    own = {key_id(k): k for k in keyring.get(signer, ())}
    if not own:
        raise Rejected(f"no public key for site '{signer}' in the keyring")
    signed = canonical_json({k: v for k, v in doc.items() if k != "signature"})
    claimed = fields["key_id"]
    key = own.get(claimed)
    if key is None or not verify(key, signed, doc["signature"]):
        # A better reason than "bad signature": whose key made it, if any listed key did (a handful of keys).
        for site, keys in keyring.items():
            if site != signer and any(key_id(k) == claimed or verify(k, signed, doc["signature"]) for k in keys):
                raise Rejected(f"signed with the key of site '{site}', but it must be signed by '{signer}'")
        if key is None:
            raise Rejected(f"signed with key {claimed}, which the keyring does not list for site '{signer}'")
        raise Rejected(f"bad signature: altered after signing, or not signed by site '{signer}' (key {claimed})")
    # The signed fields verify, but the text could still be spelled differently (spaces, key order, escapes).
    if text != canonical_json(doc) + b"\n":
        raise Rejected("not in canonical form (sorted keys, no whitespace, ASCII, one final newline)")


def _payload(json_path: Path, fields: dict[str, Any], max_bytes: int) -> dict[str, torch.Tensor]:
    path = json_path.with_name(fields["stem"] + ".safetensors")
    compressed = fields["compression"] == "zstd"
    if compressed:  # what the frame may inflate to: the safetensors file the signed specs describe, no more
        raw, data_bytes = fields["raw_bytes"], sum(s.nbytes for s in fields["specs"].values())
        if raw > max_bytes:
            raise Rejected(f"payload decompresses to {raw} bytes, over the limit of {max_bytes}")
        if not 8 + data_bytes < raw <= 8 + MAX_PAYLOAD_HEADER_BYTES + data_bytes:
            raise Rejected(
                f"payload decompresses to {raw} bytes, but its tensors take {data_bytes}: a safetensors file of "
                f"them is 8 bytes and a header of at most {MAX_PAYLOAD_HEADER_BYTES} longer"
            )
    data = _read_regular(path, max_bytes=max_bytes, what="payload", expected_size=fields["payload_bytes"])
    digest = hashlib.sha256(data).hexdigest()
    if digest != fields["payload_sha256"]:
        raise Rejected(f"payload sha256 mismatch: the file has {digest}, the record says {fields['payload_sha256']}")
    if compressed:  # only signed, hash-checked bytes reach the decompressor
        data = _decompress(data, fields["raw_bytes"])
    return _payload_tensors(data, fields["specs"])


def _decompress(data: bytes, raw_bytes: int) -> bytes:
    """The one zstd frame `data` must be, decompressed to exactly `raw_bytes` (already checked against the
    caller's bound): the frame must declare that size in its header, since zstd allocates what it declares."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise Rejected("payload is not a zstd frame") from None
    if declared != raw_bytes:
        said = "no size" if declared < 0 else f"{declared} bytes"
        raise Rejected(f"payload's zstd frame declares {said}, the record says {raw_bytes} bytes")
    try:
        out = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW).decompress(data, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise Rejected(f"payload does not decompress ({str(e)[:200]})") from None
    if len(out) != raw_bytes:
        raise Rejected(f"payload decompresses to {len(out)} bytes, the record says {raw_bytes}")
    return out


def pack_payload(tensors: Mapping[str, torch.Tensor], compression: str) -> tuple[bytes, int]:
    """What a record's payload file holds for these tensors (a safetensors file, zstd-compressed or not) and the
    size of the safetensors bytes. The writers use it, and so does whoever counts the bytes a record costs."""
    import safetensors.torch

    raw = safetensors.torch.save(dict(tensors))
    if compression == "none":
        return raw, len(raw)
    if compression != "zstd":
        raise BadInput(f"compression {compression!r}, expected one of {', '.join(COMPRESSIONS)}")
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw), len(raw)


def read_contribution(
    json_path: str | Path,
    *,
    keyring: Keyring,
    known_sites: Collection[str],
    expected_base_round: int | None = None,
    oldest_base_round: int | None = None,
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    payload: bool = True,
) -> Contribution:
    """A verified contribution, or Rejected. `max_bytes` bounds the payload file. Its base round must be
    `expected_base_round`, or (a late contribution folded into a later round) no older than
    `oldest_base_round`. payload=False verifies the signed record only, and returns no tensors (what a record
    says, for the price of its JSON: which round it builds on, with which θ digest)."""
    json_path = Path(json_path)
    try:
        text, doc, fields = _read_record(json_path, "contribution")
        site = fields["site"]
        if site not in known_sites:
            raise Rejected(f"unknown site '{site}' (known: {', '.join(sorted(known_sites)[:20]) or 'none'})")
        _check_signed(json_path, text, doc, fields, site, keyring)
        base = fields["base_round"]
        oldest = expected_base_round if oldest_base_round is None else oldest_base_round
        if oldest is not None and base < oldest:
            raise Rejected(
                f"replayed from round {base + 1}: base round {base}, expected base round {expected_base_round}"
                + (f" (or, late, {oldest} or newer)" if oldest != expected_base_round else "")
            )
        if expected_base_round is not None and base > expected_base_round:
            raise Rejected(f"for round {base + 1}, expected round {expected_base_round + 1}")
        tensors = _payload(json_path, fields, max_bytes) if payload else {}
    except Rejected as e:
        raise Rejected(e.reason, json_path) from None
    return Contribution(
        path=json_path,
        site=site,
        base_round=base,
        steps=fields["steps"],
        tokens=fields["tokens"],
        encoding=fields["encoding"],
        created=fields["created"],
        payload_sha256=fields["payload_sha256"],
        key_id=fields["key_id"],
        specs=fields["specs"],
        tensors=tensors,
        training=fields["training"],
        base_theta_sha256=fields["base_theta_sha256"],
    )


def read_round(
    json_path: str | Path,
    *,
    keyring: Keyring,
    aggregator: str,
    expected_round: int | None = None,
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    need_momentum: bool = False,
    payload: bool = True,
) -> PublishedRound:
    """A verified published round signed by one of `aggregator`'s keys, or Rejected. `max_bytes` bounds the
    payload file; `need_momentum` refuses a site's copy (θ only) where the outer state is needed. payload=False
    verifies the signed record only: θ and the momentum come back empty."""
    json_path = Path(json_path)
    try:
        text, doc, fields = _read_record(json_path, "round")
        _check_signed(json_path, text, doc, fields, aggregator, keyring)
        r = fields["round"]
        if expected_round is not None and r < expected_round:
            raise Rejected(f"replayed from round {r}, expected round {expected_round}")
        if expected_round is not None and r > expected_round:
            raise Rejected(f"for round {r}, expected round {expected_round}")
        has_momentum = any(n.startswith(MOMENTUM) for n in fields["specs"])
        if need_momentum and not has_momentum:
            raise Rejected("holds θ only (a site's copy), but the outer state needs the momentum too")
        tensors = _payload(json_path, fields, max_bytes) if payload else {}
    except Rejected as e:
        raise Rejected(e.reason, json_path) from None
    names = [n[len(THETA) :] for n in fields["specs"] if n.startswith(THETA)]
    return PublishedRound(
        path=json_path,
        aggregator=aggregator,
        round=r,
        parent=fields["parent"],
        outer=fields["outer"],
        accepted=fields["accepted"],
        rejected=fields["rejected"],
        created=fields["created"],
        payload_sha256=fields["payload_sha256"],
        key_id=fields["key_id"],
        specs=fields["specs"],
        theta={n: tensors[THETA + n] for n in names} if payload else {},
        momentum=({n: tensors[MOMENTUM + n] for n in names} if payload else {}) if has_momentum else None,
        training=fields["training"],
    )


# ---- writing ----


def _stored(tensors: Mapping[str, torch.Tensor], allowed: frozenset[str]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (tied weights, θ passed as its own momentum):
    safetensors refuses shared storage, and a file holds each tensor's own bytes anyway."""
    import torch

    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise BadInput(f"{name!r}: not a tensor")
        dtype = _DTYPE_NAMES.get(str(t.dtype))
        if dtype not in allowed:
            raise BadInput(f"{name!r}: dtype {t.dtype}, expected one of {', '.join(sorted(allowed))}")
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        if storage in seen and t.numel():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _spec_json(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    return {n: {"shape": list(t.shape), "dtype": _DTYPE_NAMES[str(t.dtype)]} for n, t in tensors.items()}


def _sign_and_publish(
    directory: Path, kind: str, fields: dict[str, Any], stored: dict[str, torch.Tensor], key: Any, compression: str
) -> Path:
    if not isinstance(key, Ed25519PrivateKey):
        raise BadInput(f"cannot write a {kind}: key is not an ed25519 private key (signing.load_private)")
    payload, raw_bytes = pack_payload(stored, compression)
    if compression != "none":
        fields.update(payload_compression=compression, payload_raw_bytes=raw_bytes)
    fields.update(
        format_version=FORMAT_VERSION,
        kind=kind,
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        payload_bytes=len(payload),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        key_id=key_id(key.public_key()),
    )
    try:  # the writer holds itself to the reader's rules
        checked = _parse_fields({**fields, "signature": ""}, kind)
    except Rejected as e:
        raise BadInput(f"cannot write a {kind}: {e.reason}") from None
    fields["signature"] = sign(key, canonical_json(fields))
    return _publish(directory, checked["stem"], fields, payload)


def _publish(directory: Path, stem: str, fields: dict[str, Any], payload: bytes) -> Path:
    json_path, payload_path = directory / f"{stem}.json", directory / f"{stem}.safetensors"
    if os.path.lexists(json_path):
        return _already_written(json_path, fields)
    _write_file(directory, payload_path.name, payload, replace=True)
    if not _write_file(directory, json_path.name, canonical_json(fields) + b"\n", replace=False):
        return _already_written(json_path, fields)
    return json_path


def _already_written(json_path: Path, fields: dict[str, Any]) -> Path:
    """An existing record of this stem: fine if it says the same (a retried tick), an error if not."""
    volatile = {"created", "signature"}
    try:
        existing = loads_json(_read_regular(json_path, max_bytes=MAX_JSON_BYTES, what="record"), source="record")
    except (Rejected, BadInput):
        existing = None
    if isinstance(existing, dict) and {k: v for k, v in existing.items() if k not in volatile} == {
        k: v for k, v in fields.items() if k not in volatile
    }:
        return json_path
    raise RuntimeFailure(f"{json_path}: already exists with different contents; a record is never overwritten")


def _write_file(directory: Path, name: str, data: bytes, *, replace: bool) -> bool:
    """Write `name` durably through a temporary name (files.atomic_write, or files.atomic_create with
    replace=False); with replace=False, False when `name` already exists."""
    path = directory / name
    try:
        if replace:
            files.atomic_write(path, data)  # replaces the file (or a planted symlink) itself, never its target
            return True
        try:
            return files.atomic_create(path, data)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        # A filesystem without hard links: check, then rename (a window only a second writer could use).
        if os.path.lexists(path):
            return False
        files.atomic_write(path, data)
        return True
    except OSError as e:
        raise RuntimeFailure(f"{path}: cannot write ({e.strerror})") from None


def write_contribution(
    directory: str | Path,
    *,
    site: str,
    base_round: int,
    steps: int,
    tokens: int,
    encoding: str,
    tensors: Mapping[str, torch.Tensor],
    key: Ed25519PrivateKey,
    compression: str = "none",
    training: str | None = None,
    base_theta_sha256: str | None = None,
) -> Path:
    """Write `contrib-<site>-r<base_round>.{safetensors,json}` signed with `key`; returns the .json path.
    compression="zstd" stores the payload as one zstd frame (lossless; int8 codes shrink to about 0.8).
    `training` and `base_theta_sha256` bind it to one training and to the θ(base) it was computed against
    (both or neither)."""
    if (training is None) != (base_theta_sha256 is None):
        raise BadInput("cannot write a contribution: training and base_theta_sha256 go together")
    if encoding not in ENCODINGS:
        raise BadInput(f"cannot write a contribution: encoding {encoding!r}, expected one of {', '.join(ENCODINGS)}")
    stored = _stored(tensors, ENCODINGS[encoding])
    fields = {
        "site": site,
        "base_round": base_round,
        "steps": steps,
        "tokens": tokens,
        "encoding": encoding,
        "tensors": _spec_json(stored),
    }
    if training is not None:
        fields |= {"training": training, "base_theta_sha256": base_theta_sha256}
    return _sign_and_publish(Path(directory), "contribution", fields, stored, key, compression)


def write_round(
    directory: str | Path,
    *,
    round: int,
    parent: int | None,
    outer: OuterStepRecord | Mapping[str, Any],
    accepted: Sequence[AcceptedContribution | Mapping[str, Any]],
    rejected: Sequence[RejectedContribution | Mapping[str, Any]],
    theta: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    key: Ed25519PrivateKey,
    compression: str = "none",
    training: str | None = None,
) -> Path:
    """Write `round-<round>.{safetensors,json}`: θ and momentum (fp32, the same names and shapes) in one payload,
    signed with `key` (the aggregator's); returns the .json path. momentum=None writes a site's copy: θ only,
    half the bytes, all a site needs to go on training."""
    if momentum is not None and set(theta) != set(momentum):
        raise BadInput("cannot write a round: theta and momentum must hold the same names")
    both = {THETA + n: t for n, t in theta.items()} | {MOMENTUM + n: t for n, t in (momentum or {}).items()}
    stored = _stored(both, frozenset({"F32"}))
    fields = {
        "round": round,
        "parent": parent,
        "outer": _outer_json(outer),
        "accepted": [_accepted_json(a) for a in accepted],
        "rejected": [_without_none(_as_dict(r, ("site", "reason", "base_round"))) for r in rejected],
        "tensors": _spec_json(stored),
    }
    if training is not None:
        fields["training"] = training
    return _sign_and_publish(Path(directory), "round", fields, stored, key, compression)


def theta_digest(theta: Mapping[str, torch.Tensor]) -> str:
    """sha256 over θ as fp32, by sorted name: each name, its shape and its bytes (little-endian). What a
    contribution's base_theta_sha256 and a training's identity are made of: the same weights give the same
    digest whichever record or file they came from."""
    import torch

    h = hashlib.sha256()
    for name in sorted(theta):
        t = theta[name].detach().to("cpu", torch.float32).contiguous()
        h.update(json.dumps([name, list(t.shape)]).encode() + b"\0")
        h.update(memoryview(t.numpy().astype("<f4", copy=False)).cast("B"))  # the tensor's own bytes, not a copy
    return h.hexdigest()


def training_id(name: str, theta0: Mapping[str, torch.Tensor]) -> str:
    """A cross-site training's identity, fixed at round 0: its config's name and θ(0)'s digest."""
    return f"{name}:{theta_digest(theta0)[:32]}"


def _accepted_json(a: AcceptedContribution | Mapping[str, Any]) -> dict[str, Any]:
    return _without_none(_as_dict(a, ("site", "payload_sha256", "tokens", "steps", "base_round", "norm")))


def _without_none(entry: dict[str, Any]) -> dict[str, Any]:
    """Optional fields left out rather than written as null (an entry's base_round, norm)."""
    for key in ("base_round", "norm"):
        if key in entry and entry[key] is None:
            entry.pop(key)
    return entry


def _outer_json(outer: OuterStepRecord | Mapping[str, Any]) -> dict[str, Any]:
    out = _as_dict(outer, ("lr", "momentum", "nesterov", "rule", "encoding"))
    if out.get("encoding") is None:
        out.pop("encoding", None)
    return out


def _as_dict(value: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    return {k: getattr(value, k) for k in keys}

"""The staging wire protocol under arbitrary bytes, both ways (hypothesis): the local side's reader and reply
checks against anything a partner site's `python3` can send, and the agent's reader against anything the
local side can send. Only clean errors (WireError / ProtocolError / EOFError at the end of the input), memory
that follows the bytes that arrived rather than what a length prefix claims, and no hang."""

from __future__ import annotations

import io
import json
import os
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcscale.portable import wire
from hpcscale.portable.errors import KINDS
from hpcscale.xsite import agent
from hpcscale.xsite.channel import ProtocolError, check_error, check_reply, shown
from hpcscale.xsite.stage import check_ack, check_get, check_plan

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
KEYS = ["op", "path", "n", "size", "offset", "error", "kind", "ok", "flushed", "statuses", "info", "clean", "lock",
        "hello", "ready", "root", "committed", "busy", "opts", "entries", "proven", "hashed", "manifest"]  # fmt: skip
objects = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6)


def frame(doc) -> bytes:
    b = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    return struct.pack(">I", len(b)) + b


def frames(body):
    """Frames of objects (some well formed, some not), raw garbage, and truncated frames, concatenated."""
    piece = st.one_of(
        body.map(frame),
        json_values.map(frame),
        st.binary(max_size=40).map(frame),
        st.binary(max_size=12),
    )
    return st.lists(piece, max_size=6).map(b"".join)


# ---- the local side's reader ----------------------------------------------------------------------------------


def _read_all(data: bytes, limit: int = wire.HEADER_MAX) -> list[dict]:
    inp, out = io.BytesIO(data), []
    while True:
        try:
            msg = wire.recv(inp, limit)
        except EOFError:
            return out
        except wire.WireError:
            return out
        assert type(msg) is dict
        out.append(msg)


@FUZZ
@given(st.binary(max_size=300) | frames(objects))
def test_the_reader_takes_any_bytes_to_objects_or_a_clean_error(data):
    _read_all(data)


@pytest.mark.parametrize(
    "data, error",
    [
        (frame(b"[1, 2]"), "JSON list"),
        (frame(b"1.5"), "JSON float"),
        (frame(b"{not json"), "not valid JSON"),
        (frame(b'{"n": NaN}'), "NaN"),
        (frame(b'{"n": 1e999}'), "out of range"),
        (frame(b'{"n": ' + b"9" * 5000 + b"}"), "digits"),
        (frame(b"[" * 200_000 + b"]" * 200_000), "nested too deeply"),
        (frame(b'{"a": "\xff"}'), "not UTF-8"),
        (struct.pack(">I", (1 << 32) - 1) + b"{}", "over the limit"),
        (struct.pack(">I", wire.HEADER_MAX + 1), "over the limit"),
    ],
)
def test_each_bound_is_a_wire_error(data, error):
    with pytest.raises(wire.WireError, match=error):
        wire.recv(io.BytesIO(data))


def test_a_length_prefix_costs_only_the_bytes_that_came():
    """Over a real pipe (a BufferedReader, as ssh's stdout is read): a reader that asked for the whole claimed
    length at once allocated it before the first byte came."""
    r, w = os.pipe()
    os.write(w, struct.pack(">I", wire.REQUEST_MAX) + b"{" * 1000)
    os.close(w)
    tracemalloc.start()
    try:
        with open(r, "rb") as inp, pytest.raises(EOFError):
            wire.recv(inp, wire.REQUEST_MAX)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def _entries(sizes):
    return [[f"f{i}", size, 0, "0" * 32, None] for i, size in enumerate(sizes)]


@FUZZ
@given(objects | st.fixed_dictionaries({"statuses": st.lists(json_values, max_size=6)}, optional={"info": json_values}),
       st.lists(st.integers(0, 10), min_size=0, max_size=6))  # fmt: skip
def test_a_plan_reply_is_checked_field_by_field(reply, sizes):
    entries = _entries(sizes)
    try:
        plan = check_plan(reply, entries)
    except ProtocolError:
        return
    assert len(plan.statuses) == len(entries)
    assert all(type(s) is int and (s == -1 or 0 <= s <= e[1]) for s, e in zip(plan.statuses, entries, strict=True))
    assert all(type(getattr(plan, k)) is int and getattr(plan, k) >= 0 for k in plan.COUNTS)
    assert plan.proven <= plan.up_to_date
    assert plan.record_ignored is None or type(plan.record_ignored) is str


@FUZZ
@given(objects, st.sets(st.sampled_from(["a", "b", "c"])))
def test_an_ack_names_a_file_in_flight_or_is_refused(msg, names):
    inflight = dict.fromkeys(names, 0)
    try:
        path, error = check_ack(msg, inflight)
    except ProtocolError:
        return
    if error is None:
        assert path == "" or path in inflight
    else:
        assert path is None or path in inflight
        assert type(error[0]) is str and error[1] in KINDS


@FUZZ
@given(objects, st.integers(0, 100), st.integers(0, 100))
def test_a_get_reply_announces_exactly_what_was_asked_or_is_refused(msg, size, offset):
    offset = min(offset, size)
    try:
        error = check_get(msg, ["a", size, 0, "0" * 32, None], offset)
    except ProtocolError:
        return
    if error is None:
        assert msg["n"] == size - offset and type(msg["n"]) is int and msg["path"] == "a"


@FUZZ
@given(objects, st.sampled_from(["hello", "init", "commit"]))
def test_error_and_success_replies_are_type_checked(msg, op):
    try:
        if "error" in msg:
            text, kind = check_error(msg)
            assert type(text) is str and kind in KINDS
        else:
            check_reply(op, msg)
    except ProtocolError:
        pass


@FUZZ
@given(st.text(max_size=60))
def test_shown_text_has_no_control_characters(text):
    out = shown(text)
    assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 or 0xD800 <= ord(c) < 0xE000 for c in out), out
    out.encode("utf-8")  # printable: no lone surrogate left


# ---- the agent's reader ---------------------------------------------------------------------------------------

OPTS = st.fixed_dictionaries(
    {"algorithm": st.sampled_from(["xxh128", "sha256", "x"])},
    optional={"bwlimit": json_values, "idle_s": json_values, "beat_s": json_values, "jobs": json_values},
)
REQUEST = st.fixed_dictionaries(
    {"op": st.sampled_from(["init", "plan", "put", "get", "flush", "commit", "bye", "?"])},
    optional={
        "opts": json_values | OPTS,
        "path": st.sampled_from(["a.bin", "../x", "", "b/c"]) | json_values,
        "n": st.integers(-2, 8) | json_values,
        "size": st.integers(-1, 8) | json_values,
        "offset": st.integers(-1, 8) | json_values,
        "entries": json_values,
        "hash": json_values,
        "manifest": json_values,
    },
)
REQUESTS = REQUEST | objects


@pytest.mark.parametrize("role", ["sink", "source"])
@FUZZ
@given(data=st.binary(max_size=200) | frames(REQUESTS))
def test_the_agent_takes_any_bytes_to_replies_or_a_clean_end(tmp_path_factory, role, data):
    root = tmp_path_factory.mktemp("root")
    (root / "a.bin").write_bytes(b"12345678")
    out = io.BytesIO()
    saved = agent.IDLE_LIMIT[0], agent.BEAT[0]
    try:
        agent.serve(role, str(root), io.BytesIO(data), out)
    except (EOFError, agent.Desync):
        pass  # the stream ended inside a request, or out of step: the agent ends (a rerun resumes)
    finally:
        agent.IDLE_LIMIT[0], agent.BEAT[0] = saved
    replies = _agent_replies(out.getvalue())  # whatever it wrote is whole frames of objects, in step
    assert replies and replies[0].get("hello") == 1


def _agent_replies(data: bytes) -> list[dict]:
    """Every reply the agent wrote, each a bounded object; a get reply's announced bytes follow it."""
    inp, out = io.BytesIO(data), []
    while True:
        try:
            msg = wire.recv(inp)
        except EOFError:
            return out
        out.append(msg)
        if "n" in msg and "error" not in msg:
            assert len(wire.read_exact(inp, msg["n"])) == msg["n"]

"""Health signals' parts on their own: rank 0's poller (new signs once, the cooldown, a scheduler that fails) and
the reading of scontrol's text, which another program writes (any text: no exception, bounded evidence). The whole
path runs on the local cluster in tests/recovery/test_health.py."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.launch.health import HealthWatch, NoHealthWatch
from hpcscale.slurm import health


def test_a_sign_is_taken_once_and_asks_for_one_save_per_cooldown():
    answers = [[{"kind": "drain", "node": "n2", "evidence": "State=IDLE+DRAIN"}]]
    watch = HealthWatch(lambda: answers[-1], poll_s=3600, cooldown_s=0.3)
    assert not watch.wants_save() and watch.take() == []
    watch.poll()
    assert watch.wants_save()
    (sign,) = watch.take()
    assert sign["node"] == "n2" and sign["seen"] > 0 and watch.take() == []
    watch.saved()
    watch.poll()  # the same sign again: not new
    assert not watch.wants_save() and watch.take() == []
    answers.append([{"kind": "reservation", "node": "n1", "evidence": "ReservationName=m"}])
    watch.poll()
    assert len(watch.take()) == 1 and not watch.wants_save()  # new, but within the cooldown
    time.sleep(0.35)
    assert watch.wants_save()  # still due once the cooldown has passed


def test_a_sign_only_to_be_logged_asks_for_no_save():
    """health.stragglers: warn (the default): the verdict's sign is logged (taken) and takes no checkpoint; save."""
    watch = HealthWatch(None, poll_s=30, cooldown_s=0).start()
    watch.add([{"kind": "straggler", "node": "n1", "key": "rank 0", "act": False, "evidence": "rank 0: 1.3x"}])
    assert not watch.wants_save()
    (sign,) = watch.take()
    assert "act" not in sign and "key" not in sign and sign["evidence"] == "rank 0: 1.3x"
    watch.add([{"kind": "straggler", "node": "n1", "key": "rank 0", "act": True, "evidence": "rank 0: 1.5x"}])
    assert not watch.wants_save() and watch.take() == []  # the same rank again: not new
    watch.add([{"kind": "straggler", "node": "n2", "key": "rank 2", "act": True, "evidence": "rank 2: 1.5x"}])
    assert watch.wants_save() and len(watch.take()) == 1
    watch.stop()


def test_a_scheduler_that_fails_gives_no_sign_and_the_poller_goes_on():
    def broken():
        raise OSError("scontrol: no answer")

    watch = HealthWatch(broken, poll_s=0.01, cooldown_s=0).start()
    time.sleep(0.1)
    watch.stop()
    assert watch.errors >= 1 and not watch.wants_save() and watch.take() == []
    assert not NoHealthWatch().wants_save() and NoHealthWatch().take() == []


@given(line=st.text(max_size=400))
@settings(max_examples=300, deadline=None)
def test_any_scontrol_line_reads_without_error_and_bounded(line):
    fields = health._fields(line)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    assert len(health._reason(line)) <= health.EVIDENCE_CHARS
    health._when(fields.get("StartTime"))


def test_a_nodes_reason_is_read_whole_and_times_that_do_not_parse_are_none():
    line = (
        "NodeName=n2 Arch=x86_64 State=IDLE+DRAIN ThreadsPerCore=1 "
        + "Reason=ECC errors on GPU 3 [root@2026-11-28T18:00:00]"
    )
    assert health._fields(line)["State"] == "IDLE+DRAIN"
    assert health._reason(line) == "ECC errors on GPU 3 [root@2026-11-28T18:00:00]"
    assert health._when("2026-11-28T18:00:00") is not None
    assert health._when("Unknown") is None and health._when("yesterday") is None and health._when(None) is None
    # free text in a Reason changes no field: the node's own state and name stand
    forged = "NodeName=n2 State=IDLE+DRAIN Reason=ok NodeName=n1 State=IDLE now"
    assert health._fields(forged) == {"NodeName": "n2", "State": "IDLE+DRAIN"}
    assert health._reason(forged) == "ok NodeName=n1 State=IDLE now"

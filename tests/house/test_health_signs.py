"""Health signals' parts on their own: rank 0's poller (new signs once, the cooldown, a scheduler that fails) and
the reading of scontrol's text, which another program writes (any text: no exception, bounded evidence). The whole
path runs on the local cluster in tests/recovery/test_health.py."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.errors import BadInput
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


def test_a_source_whose_evidence_changes_at_every_poll_never_hides_another_nodes_first_sign():
    """A node whose evidence changes at every poll (a reason stamped with its time, a count that grows), for far
    longer than the poller remembers: each new evidence is taken, a first sign of another node or kind after
    all of them is still taken and asks for a save, and what is remembered stays bounded."""
    from hpcscale.launch.health import SEEN_PER_SOURCE, SEEN_SOURCES

    watch = HealthWatch(None, poll_s=30, cooldown_s=0)
    flood = 3 * (SEEN_PER_SOURCE + SEEN_SOURCES)
    for i in range(flood):
        watch.add([{"kind": "drain", "node": "n1", "evidence": f"State=DRAIN Reason=hot [root@{i}]"}])
    assert len(watch.take()) == flood  # every change logged
    watch.saved()
    for i in range(flood):  # as many nodes as the poller remembers, three times over, each its own first sign
        watch.add([{"kind": "down", "node": f"x{i}", "evidence": "State=DOWN"}])
    assert len(watch.take()) == flood
    watch.saved()
    watch.add([{"kind": "drain", "node": "n2", "evidence": "State=DRAIN Reason=ECC"}])
    assert watch.wants_save() and [s["node"] for s in watch.take()] == ["n2"]
    watch.add([{"kind": "drain", "node": "n2", "evidence": "State=DRAIN Reason=ECC"}])  # the same: not new
    assert watch.take() == []
    assert len(watch._seen) <= SEEN_SOURCES and all(len(k) <= SEEN_PER_SOURCE for k in watch._seen.values())


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


class _Nvml:
    """NVML's names as nvidia-ml-py has them, answering as a GPU with `ecc` uncorrected errors, rows pending
    remapping, Xid events queued and clock event reasons would: this machine has no GPU and no driver (a GPU
    machine proves the real answers), and what hpcscale makes of them is the logic tested here."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_ERROR_TIMEOUT = 1, 0, 10
    nvmlEventTypeXidCriticalError = 8
    nvmlClocksEventReasonHwThermalSlowdown, nvmlClocksEventReasonSwPowerCap = 0x40, 0x4
    nvmlClocksEventReasonSwThermalSlowdown = 0x20

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

    def __init__(self, *, ecc=0, supported=True):
        self.ecc, self.pending, self.failed, self.xids, self.mask, self.supported = ecc, False, False, [], 0, supported
        self.events_broken, self.freed = False, []

    def nvmlEventSetFree(self, events):
        self.freed.append(events)

    def _check(self):
        if not self.supported:
            raise self.NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        self._check()
        assert (kind, counter) == (1, 0)
        return self.ecc

    def nvmlDeviceGetRemappedRows(self, h):
        self._check()
        return (0, 0, self.pending, self.failed)

    def nvmlEventSetCreate(self):
        self._check()
        return "set"

    def nvmlDeviceRegisterEvents(self, h, kinds, events):
        assert kinds == self.nvmlEventTypeXidCriticalError and events == "set"

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        assert timeout_ms == 0  # never waits on the training thread
        if self.events_broken:
            raise self.NVMLError(999)  # NVML_ERROR_UNKNOWN
        if not self.xids:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)

        class Data:
            eventData = self.xids.pop(0)

        return Data

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._check()
        return self.mask


def test_a_gpus_own_signs_are_read_from_nvml_each_once_as_the_health_watch_takes_them():
    from hpcscale.launch.nvml import XID_PER_READ, DeviceSigns

    nvml = _Nvml(ecc=3)  # three errors before the attempt started: not this attempt's
    signs = DeviceSigns(nvml, "h", where="rank 5 GPU-abc", node="n7")
    watch = HealthWatch(None, poll_s=30, cooldown_s=0)
    assert signs.read(0) == []
    nvml.mask = _Nvml.nvmlClocksEventReasonSwPowerCap  # a power cap is a policy, not a sign
    assert signs.read(1) == []
    nvml.ecc, nvml.pending, nvml.xids = 5, True, [79, 48]
    nvml.mask |= _Nvml.nvmlClocksEventReasonHwThermalSlowdown
    found = signs.read(2)
    assert [(s["kind"], s["node"]) for s in found] == [("ecc", "n7"), ("row_remap", "n7"), ("xid", "n7"),
                                                       ("xid", "n7"), ("throttle", "n7")]  # fmt: skip
    words = [s["evidence"] for s in found]
    assert words[0] == "rank 5 GPU-abc: 2 uncorrected ECC error(s) since the attempt started"
    assert "pending" in words[1] and "Xid 79" in words[2] and "Xid 48" in words[3] and "hw_thermal" in words[4]
    watch.add(found)
    assert watch.pending() and watch.wants_save() and len(watch.take()) == 5
    watch.saved()
    watch.add(signs.read(3))  # the same state read again: nothing new, no save asked
    assert not watch.pending() and not watch.wants_save()
    nvml.failed = True
    (failed,) = [s for s in signs.read(4) if s["kind"] == "row_remap"]
    assert "failed" in failed["evidence"]
    # other reasons for the held clocks: still the one throttle sign of this rank (a hot room flaps)
    nvml.mask = _Nvml.nvmlClocksEventReasonHwThermalSlowdown | _Nvml.nvmlClocksEventReasonSwThermalSlowdown
    assert "hw_thermal, sw_thermal" in next(s for s in signs.read(5) if s["kind"] == "throttle")["evidence"]
    watch.add(signs.read(5))
    assert [s["kind"] for s in watch.take()] == ["row_remap"]
    # an Xid a program can cause (31: an illegal memory access) is logged and suspects nothing; at most
    # XID_PER_READ are taken at one read
    nvml.pending = nvml.failed = False
    nvml.xids = [31] + [79] * 40
    found = [s for s in signs.read(6) if s["kind"] == "xid"]
    assert len(found) == XID_PER_READ and found[0]["suspect"] is False and "program" in found[0]["evidence"]
    assert all("suspect" not in s for s in found[1:])
    # an error other than "nothing waiting" stops the event reads for good; the set goes back at close
    nvml.events_broken = True
    assert [s for s in signs.read(7) if s["kind"] == "xid"] == []
    nvml.events_broken = False
    assert [s for s in signs.read(8) if s["kind"] == "xid"] == []  # 79s still queued: not read any more
    signs.close()
    assert nvml.freed == []  # already dropped after the error
    fresh = DeviceSigns(_Nvml(), "h", where="rank 0", node="n1")
    fresh.close()
    assert fresh._nvml.freed == ["set"]


def test_a_gpu_without_the_counters_gives_no_sign_and_no_error():
    from hpcscale.launch.nvml import DeviceSigns, InjectedSign, device_signs

    signs = DeviceSigns(_Nvml(supported=False), "h", where="rank 0", node="n1")
    assert signs.read(0) == [] and signs.read(1) == []
    assert device_signs(None, rank=0, node="n1") is None or os.environ.get("HPCSCALE_DEVICE_SIGN")  # CPU: none
    injected = InjectedSign("ecc@3:1", rank=1, where="rank 1", node="n2")
    assert injected.read(2) == [] and injected.read(3)[0]["kind"] == "ecc"
    assert InjectedSign("ecc@3:1", rank=0, where="rank 0", node="n2").read(9) == []
    for bad in ("drain@0", "xid@x", "ecc@1:y"):  # only a GPU's kinds: a drain is Slurm's to say
        with pytest.raises(BadInput, match="HPCSCALE_DEVICE_SIGN"):
            InjectedSign(bad, rank=0, where="rank 0", node="n1")
    # an ECC counter that answers nothing at first (off, then on): no sign from it, no error
    nvml = _Nvml(supported=False)
    late = DeviceSigns(nvml, "h", where="rank 0", node="n1")
    nvml.supported, nvml.ecc = True, 7
    assert [s["kind"] for s in late.read(1)] == []


def test_only_a_nodes_own_signs_that_acted_make_it_suspect(tmp_path):
    """signed_nodes (what resume and the relaunch hold against a node): Slurm's node states and a GPU's failing
    hardware, on the newest attempt's nodes; not a sign that only warned (health.devices: warn, an Xid a program
    can cause), a reservation, a straggler, or a node the attempt did not run on."""
    import json

    from hpcscale.rundir import RunDir
    from hpcscale.slurm.status import signed_nodes

    run = tmp_path / "run"
    run.mkdir()
    begins = [{"event": "begin", "attempt": 1, "nodes": ["n1", "n2"]}, {"event": "begin", "attempt": 2,
              "nodes": ["n1", "n2", "n3", "n4", "n5"]}]  # fmt: skip
    (run / "attempts.jsonl").write_text("".join(json.dumps(b) + "\n" for b in begins))
    signs = [
        {"kind": "drain", "node": "n1", "evidence": "State=DRAIN Reason=fan"},
        {"kind": "xid", "node": "n2", "evidence": "rank 2: Xid 79", "suspect": True},
        {"kind": "xid", "node": "n3", "evidence": "rank 4: Xid 31 (a program can cause it)", "suspect": False},
        {"kind": "ecc", "node": "n4", "evidence": "rank 6: 1 uncorrected", "suspect": False},  # devices: warn
        {"kind": "reservation", "node": "n5", "evidence": "ReservationName=m"},
        {"kind": "drain", "node": "n9", "evidence": "not this attempt's node"},
    ]
    rows = [{"attempt": 1, "step": 3, "health": [{"kind": "drain", "node": "n5", "evidence": "old"}]},
            {"attempt": 2, "step": 9, "health": signs}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = signed_nodes(RunDir(run))
    assert sorted(found) == ["n1", "n2"], found
    assert found["n1"] == "drain: State=DRAIN Reason=fan" and "Xid 79" in found["n2"]
    # a node that showed more than one sign: each kind, the first of it, oldest first (n1 stopped answering after
    # it was drained: the drain's reason is what an operator needs)
    more = [{"kind": "not_responding", "node": "n1", "evidence": "NOT_RESPONDING"},
            {"kind": "drain", "node": "n1", "evidence": "State=DRAIN Reason=other"}]  # fmt: skip
    later = [{"attempt": 2, "step": 11, "health": more}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + later))
    found = signed_nodes(RunDir(run))
    assert found["n1"] == "drain: State=DRAIN Reason=fan; not_responding: NOT_RESPONDING", found

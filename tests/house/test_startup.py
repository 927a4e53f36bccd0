"""How hpcscale's processes start: the cyclic garbage collector paused for a rank's start-up imports
(hpcscale.util.pystart.pause_collector / resume_collector). Each case runs in a fresh interpreter: a freeze is
for the whole process. The ranks' own start-up is checked in tests/ckpt/test_host_memory.py (environ_entry)."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import gc, json, sys
from hpcscale.util import pystart
seen = {}
if sys.argv[1] == "off-before":
    gc.disable()
pystart.pause_collector()
seen["paused"] = not gc.isenabled()
import email.mime.multipart, xml.dom.minidom  # a start-up's imports: objects that live to the end
held = [[] for _ in range(1000)]
pystart.resume_collector()
seen["enabled"] = gc.isenabled()
seen["frozen"] = gc.get_freeze_count()
pystart.resume_collector()  # a second resume does nothing
seen["frozen_again"] = gc.get_freeze_count()
print(json.dumps(seen))
"""


def _probe(case: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, case], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_start_up_imports_run_with_the_collector_paused_then_frozen_and_the_collector_back_on():
    seen = _probe("on")
    assert seen["paused"] and seen["enabled"]
    assert seen["frozen"] >= 1000 and seen["frozen_again"] == seen["frozen"]  # the held lists among them


def test_a_collector_someone_turned_off_stays_off_and_nothing_is_frozen():
    seen = _probe("off-before")
    assert seen == {"paused": True, "enabled": False, "frozen": 0, "frozen_again": 0}

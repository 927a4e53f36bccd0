"""How hpcscale's processes start and end: the cyclic garbage collector paused for a rank's start-up imports
(hpcscale.util.pystart.pause_collector / resume_collector) and for the first import of torch in any command
(load_paused); a command's end without the interpreter's teardown (exit_now), which must still do everything
the ordinary exit does that anyone outside the process can see. Each case runs in a fresh interpreter: a freeze
is for the whole process. The ranks' own start-up is checked in tests/ckpt/test_host_memory.py (environ_entry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


# a module that notes whether the collector ran while it was being imported, and makes objects that live on
_NOTING = """
import gc
ON_DURING_IMPORT = gc.isenabled()
HELD = [[] for _ in range(1000)]
"""

_LOAD_PROBE = """
import gc, json, sys
from hpcscale.util import pystart
if sys.argv[1] == "off-before":
    gc.disable()
pystart.load_paused("noted", "also_noted")
finders = len(sys.meta_path)
import plain, noted, also_noted
print(json.dumps({"plain": plain.ON_DURING_IMPORT, "noted": noted.ON_DURING_IMPORT,
                  "also_noted": also_noted.ON_DURING_IMPORT, "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count(), "finders_added": finders - len(sys.meta_path)}))
"""


@pytest.mark.parametrize("case", ["on", "off-before"])
def test_the_first_named_import_runs_with_the_collector_paused_and_is_frozen_after(tmp_path, case):
    """load_paused: the named module's code runs with the collector off and what is alive after is frozen; the
    finder leaves at that first import (the second name, loaded after, runs with the collector on, as does any
    other module); a collector someone turned off stays off and nothing is frozen."""
    for name in ("plain", "noted", "also_noted"):
        (tmp_path / f"{name}.py").write_text(_NOTING)
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE, case],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    if case == "on":
        assert seen == {**seen, "plain": True, "noted": False, "also_noted": True, "enabled": True}
        assert seen["frozen"] >= 1000 and seen["finders_added"] == 1
    else:
        assert seen == {"plain": False, "noted": False, "also_noted": False, "enabled": False, "frozen": 0,
                        "finders_added": 1}  # fmt: skip


def test_a_named_module_another_kind_of_loader_finds_is_loaded_as_usual(tmp_path):
    """A zip archive's modules share one loader: load_paused patches only a file loader, its module's alone, so
    a named module from a zip loads as usual (collector on, nothing frozen), and the finder still leaves."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "mods.zip", "w") as z:
        z.writestr("zipped.py", _NOTING)
    probe = ("import gc, json, sys; from hpcscale.util import pystart; pystart.load_paused('zipped'); "
             "n = len(sys.meta_path); import zipped; print(json.dumps([zipped.ON_DURING_IMPORT, gc.get_freeze_count(), "
             "n - len(sys.meta_path)]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "mods.zip")})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True, 0, 1]


# What a command's process leaves when it ends through the console script's exit (exit_now): a non-daemon thread
# still working, an executor left open with work queued, an atexit handler, and an object in an unreachable
# cycle whose finalizer writes a file, all of them done, as the ordinary exit does them; an object a module still
# holds is not torn down (its __del__ would write a file): the teardown is what the exit skips.
_EXIT_PROBE = """
import atexit, concurrent.futures, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
def late(name):
    time.sleep(0.3)
    (out / name).write_text("done")
threading.Thread(target=late, args=("thread",)).start()
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(late, "executor")
atexit.register(lambda: (out / "atexit").write_text("done"))
class Cycle:
    def __del__(self):
        (out / "collected").write_text("done")
c = Cycle()
c.me = c
del c
class Held:
    def __del__(self):
        (out / "torn-down").write_text("yes")
held = Held()
sys.argv = ["hpcscale", *sys.argv[2:]]
from hpcscale.cli.entry import main
main()
"""


def test_a_command_ends_without_the_teardown_yet_everything_the_exit_does_outside_it_is_done(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: t\nsite: local\nnodes: 2\nnodez: 3\n")
    for args, code in ((["--version"], 0), (["config", "validate", str(job)], 2)):
        d = tmp_path / args[0]
        d.mkdir()
        out = subprocess.run(
            [sys.executable, "-c", _EXIT_PROBE, str(d), *args], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == code, out.stderr
        assert sorted(p.name for p in d.iterdir()) == ["atexit", "collected", "executor", "thread"], out.stderr
    assert "nodez" in out.stderr and "Traceback" not in out.stderr


def test_a_long_output_arrives_whole_through_a_pipe_and_a_closed_pipe_still_fails(tmp_path):
    """The flush before the end: `manifest diff` of 2,500 added files (about 200 KiB of table, more than a pipe
    holds) reaches a reader that starts reading late, and its exit code; a reader that
    closed the pipe gets a failure, not a hang or a lost error."""
    import time

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("x")
    (tmp_path / "b").mkdir()
    for i in range(2500):
        (tmp_path / "b" / f"a-file-with-a-long-name-to-fill-the-pipe-{i}.txt").write_text(str(i))
    for side in "ab":
        build = ["hpcscale", "manifest", "build", str(tmp_path / side), "-o", str(tmp_path / f"{side}.json")]
        built = subprocess.run(build, capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
    diff = ["hpcscale", "manifest", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    whole = subprocess.run(diff, capture_output=True, text=True, timeout=60)
    assert whole.returncode == 0 and len(whole.stdout) > 65536 and "pipe-2499.txt" in whole.stdout, whole.stderr
    slow = subprocess.Popen(diff, stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the command has filled the pipe and waits on it
    assert slow.stdout.read() == whole.stdout and slow.wait(timeout=60) == 0
    closed = subprocess.Popen(diff, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    closed.stdout.close()
    assert closed.wait(timeout=60) != 0


def test_a_rank_of_mpirun_that_ends_through_the_console_script_finalizes_mpi(mpi, tmp_path):
    """mpi4py registers MPI_Finalize below Python's atexit, where os._exit does not reach: exit_now calls it, so
    mpirun sees both ranks end properly (it reports, and fails, a rank that exits without it)."""
    probe = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); import sys; sys.argv = ['hpcscale', '--version']; " \
        "from hpcscale.cli.entry import main; main()"  # fmt: skip
    env = {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_btl": "self,tcp",
    }
    out = subprocess.run(
        [mpi, "-n", "2", "--oversubscribe", sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=120, env=env, cwd=Path(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("hpcscale") == 2 and "finalize" not in (out.stdout + out.stderr).lower()

"""The start and end of the tests' own rank programs (nodelocal_ranks.py, ckpt_job.py, ...), as `hpcscale launch`
starts and ends a rank (hpcscale.util.pystart): imported before torch, it pauses the cyclic collector for the
program's imports; `imported()` freezes what they made and turns it back on; `finish()` ends the process without
the interpreter's teardown (MPI finalized where it was initialized). Each start of such a program costs a test
about a second and a half of CPU; these take a third of it off."""

from hpcscale.util import pystart

pystart.pause_collector()


def imported() -> None:
    pystart.resume_collector()


def finish(code: int = 0) -> None:
    pystart.exit_now(code)
    raise SystemExit(code)  # a flush failed: the ordinary exit reports it

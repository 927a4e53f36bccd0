"""The console script `hpcscale` (and `python -m hpcscale`): nothing runs at import time.

`hpcscale stage` over ssh spends most of a no-op rerun waiting for ssh to connect, so `main` starts ssh before
click and the command modules load (hpcscale.xsite.channel.prelaunch). The stage command
adopts that connection only if its parsed options ask for the same endpoint; otherwise it is closed.

When `stage` is done and its output written, the process ends without the interpreter's teardown (freeing
every module, a measurable part of a cron-driven no-op rerun over ssh): stdout, stderr and logging are
flushed first, and nothing of stage's is left for a finalizer (ssh and every thread are waited for inside).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["run"] and argv is None:
        # `hpcscale run`'s stop signals are held from here until its StopForwarder takes them (before mpirun
        # starts): one that comes while the front end is still importing is then a stop, not its death
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP, signal.SIGINT))
    staging = args[:1] == ["stage"]
    if staging:
        from hpcscale.xsite.channel import prelaunch

        prelaunch(args[1:])
    from hpcscale.cli.main import cli

    if not (staging and argv is None):  # called as a function (tests, embedding): return as usual
        cli(args, prog_name="hpcscale")
        return
    try:
        cli(args, prog_name="hpcscale")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        from hpcscale.xsite.channel import discard_prelaunched

        discard_prelaunched()  # an early ssh nothing took (click refused the command line): _exit_now skips atexit
    if code is None or type(code) is int:
        _exit_now(code or 0)
    raise SystemExit(code)


def _exit_now(code: int) -> None:
    """Flush what the command wrote, then end the process at once; where a flush fails (a closed pipe), return
    and let the ordinary exit report it."""
    import os

    try:
        if "logging" in sys.modules:
            sys.modules["logging"].shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        return
    os._exit(code)

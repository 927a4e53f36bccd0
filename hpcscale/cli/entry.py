"""The console script `hpcscale` (and `python -m hpcscale`): nothing runs at import time.

`hpcscale stage` over ssh spends most of a no-op rerun waiting for ssh to connect, so `main` starts ssh before
click and the command modules load (hpcscale.xsite.channel.prelaunch). The stage command
adopts that connection only if its parsed options ask for the same endpoint; otherwise it is closed.

When a command is done (it returned, or exited with a code), the process does what the interpreter's exit does
that anything outside it can see, then ends without the interpreter's teardown (hpcscale.util.pystart.exit_now).
The teardown frees every module and object one by one: 0.3 to 0.5 s of CPU in a process that loaded torch (a
cross-site tick that handled tensors, `ckpt export`, a rank that stopped or failed), about 6 % of a short
command's (`config validate`). A command that raised anything else than SystemExit gets the ordinary exit (its
traceback), and so does one whose output cannot be flushed (a reader closed the pipe: Python reports it and
exits 120). torch, in a command that loads it, loads with the collector paused (pystart.load_paused).
"""

from __future__ import annotations

import sys

from hpcscale.util.pystart import exit_now, load_paused  # stdlib only: nothing else loads with it


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["run"] and argv is None:
        # `hpcscale run`'s stop signals are held from here until its StopForwarder takes them (before mpirun
        # starts): one that comes while the front end is still importing is then a stop, not its death
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGHUP, signal.SIGINT))
    if argv is None:  # torch, where a command loads it, with the collector paused (a rank's start-up pauses its own)
        load_paused("torch")
    staging = args[:1] == ["stage"]
    if staging:
        from hpcscale.xsite.channel import prelaunch

        prelaunch(args[1:])
    from hpcscale.cli.main import cli

    if argv is not None:  # called as a function (tests, embedding): return as usual
        cli(args, prog_name="hpcscale")
        return
    try:
        cli(args, prog_name="hpcscale")
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        if staging:
            from hpcscale.xsite.channel import discard_prelaunched

            discard_prelaunched()  # an early ssh nothing took (click refused the command line)
    if code is None or type(code) is int:
        exit_now(code or 0)
    raise SystemExit(code)

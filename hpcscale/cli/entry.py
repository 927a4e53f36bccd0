"""The console script `hpcscale` (and `python -m hpcscale`): nothing runs at import time.

`hpcscale stage` over ssh spends most of a no-op rerun waiting for ssh to connect, so `main` starts ssh before
click and the command modules load (about 50 ms earlier; hpcscale.xsite.channel.prelaunch). The stage command
adopts that connection only if its parsed options ask for the same endpoint; otherwise it is closed.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["stage"]:
        from hpcscale.xsite.channel import prelaunch

        prelaunch(args[1:])
    from hpcscale.cli.main import cli

    cli(args, prog_name="hpcscale")

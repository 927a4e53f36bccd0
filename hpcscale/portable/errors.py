"""The one error portable code raises, and the kinds that both ends of a transfer share.

hpcscale.errors is not available on the remote side, so a StageError carries a kind instead of a class. The
kind travels in the agent's error replies (hpcscale/xsite/agent.py) and the local side maps it to hpcscale's
errors and exit codes (hpcscale.xsite.channel.error_for; hpcscale/data maps it to BadInput where a manifest
or a root is unacceptable).
"""

KINDS = ("input", "verify", "missing", "runtime")


class StageError(Exception):
    """kind: 'input' (exit 2: the manifest or a path is unacceptable), 'verify' (exit 3: content does not match
    the manifest), 'missing' (a source file is not there; exit 1), 'runtime' (exit 1)."""

    def __init__(self, message, kind="runtime"):
        super().__init__(message)
        self.kind = kind

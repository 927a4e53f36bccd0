"""Errors that carry hpcscale's exit-code contract (docs/user-guide.md, "Exit codes").

0 success; 1 a runtime failure; 2 bad input; 3 a verification failure; 75 stopped on request (a training
run that checkpointed and stopped on a signal: resume it). The CLI turns an HpcscaleError into its message and
exit code; nothing else it raises reaches the user as a traceback for bad input.
"""

from __future__ import annotations

# the public API (docs/context-api.md, docs/huggingface.md, docs/checkpoint-format.md): what user code imports
__all__ = ["STOPPED_EXIT_CODE", "BadInput", "HpcscaleError", "RuntimeFailure", "VerificationFailure"]

# EX_TEMPFAIL (sysexits.h): stopped on request; resume from the last checkpoint. Ranks, `run --local` and the
# sbatch templates' requeue logic all mean this one number.
STOPPED_EXIT_CODE = 75


class HpcscaleError(Exception):
    """Base of every error the CLI reports without a traceback."""

    exit_code = 1


class RuntimeFailure(HpcscaleError):
    """Something outside us failed: Slurm refused, a transfer broke, a tool is missing."""

    exit_code = 1


class BadInput(HpcscaleError):
    """Usage or input the user can fix: invalid config, spec, manifest or argument."""

    exit_code = 2


class VerificationFailure(HpcscaleError):
    """Data failed a check: corrupt checkpoint, checksum mismatch."""

    exit_code = 3

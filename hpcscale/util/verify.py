"""What a verification checked and what it found: the one shape for `manifest verify` and `ckpt verify`.

A report names every problem it found (not just the first), each where the user will look for it: a file under
the root for a manifest, a data file with its tensor and chunk for a checkpoint. The commands print the
problems, print `to_json()` with `--json`, and exit 3 when there is any.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyProblem:
    path: str  # relative to the report's root: the listed file, or the checkpoint data file holding the chunk
    problem: str  # "missing", "size 10, manifest says 4096", "tensor w: chunk H at offset O does not match its hash"


@dataclass(slots=True, kw_only=True)
class VerifyReport:
    target: str  # what was verified: the manifest file, or the checkpoint's step directory
    root: str  # where the verified bytes live
    items: int  # files listed (manifest) or chunk references (checkpoint)
    bytes: int  # bytes those items cover
    ok: int = 0  # items that matched
    problems: list[VerifyProblem] = field(default_factory=list)
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)  # what only one kind has: a checkpoint's step, tensors

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "root": self.root,
            "passed": self.passed,
            "items": self.items,
            "bytes": self.bytes,
            "ok": self.ok,
            "problems": [asdict(p) for p in self.problems],
            "seconds": round(self.seconds, 3),
            **self.details,
        }

"""`hpcscale config validate`: check many files, report every problem, never stop at the first file."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpcscale.config.errors import ConfigError, ConfigIssue
from hpcscale.config.load import detect_kind, load_job, parse_site
from hpcscale.config.yamlsrc import load_yaml

Kind = Literal["site", "job"]


@dataclass(slots=True)
class FileResult:
    file: str
    kind: Kind | None
    name: str | None = None
    issues: list[ConfigIssue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.issues

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "kind": self.kind,
            "name": self.name,
            "ok": self.ok,
            "issues": [{"file": i.file, "line": i.line, "key": i.key, "message": i.message} for i in self.issues],
        }


def validate_files(
    paths: Iterable[str | Path], *, kind: Kind | None = None, site: str | None = None
) -> list[FileResult]:
    """One FileResult per path. `kind` forces site/job; otherwise it is read off the file's keys."""
    results = []
    for path in paths:
        result = FileResult(str(path), kind)
        try:
            src = load_yaml(path)
            result.kind = kind or detect_kind(src)
            if result.kind == "site":
                result.name = parse_site(src).name
            else:
                result.name = load_job(path, site=site).spec.name
        except ConfigError as e:
            result.issues = e.issues
        results.append(result)
    return results

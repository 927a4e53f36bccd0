"""`hpcscale config validate`: check many files, report every problem, never stop at the first file."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hpcscale.config.errors import ConfigError, ConfigIssue
from hpcscale.config.job import JobSpec
from hpcscale.config.load import detect_kind, load_job, parse_site
from hpcscale.config.overrides import parse_overrides
from hpcscale.config.yamlsrc import YamlSource, load_yaml

Kind = Literal["site", "job", "xsite"]


@dataclass(slots=True)
class FileResult:
    file: str
    kind: Kind | None
    name: str | None = None
    issues: list[ConfigIssue] = field(default_factory=list)
    warnings: list[ConfigIssue] = field(default_factory=list)  # valid but likely wrong: never fatal
    spec: JobSpec | None = None  # a valid job spec, and the YAML it came from (line numbers for later checks)
    source: YamlSource | None = None

    @property
    def ok(self) -> bool:
        return not self.issues

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "kind": self.kind,
            "name": self.name,
            "ok": self.ok,
            "issues": [_issue_json(i) for i in self.issues],
            "warnings": [_issue_json(i) for i in self.warnings],
        }


def _issue_json(i: ConfigIssue) -> dict:
    return {"file": i.file, "line": i.line, "key": i.key, "message": i.message}


def validate_files(
    paths: Iterable[str | Path], *, kind: Kind | None = None, site: str | None = None, overrides: Sequence[str] = ()
) -> list[FileResult]:
    """One FileResult per path. `kind` forces site/job; otherwise it is read off the file's keys. `overrides`
    (-p KEY=VALUE) apply to every job spec, not to site configs; a malformed one raises at once (exit 2)."""
    parse_overrides(overrides)  # the command line's own mistake, before any file is read
    results = []
    for path in paths:
        result = FileResult(str(path), kind)
        try:
            src = load_yaml(path)
            result.kind = kind or detect_kind(src)
            if result.kind == "site":
                result.name = parse_site(src).name
            elif result.kind == "xsite":
                from hpcscale.config.xsite import parse_xsite

                result.name = parse_xsite(src).name
            else:
                loaded = load_job(path, site=site, overrides=overrides)
                result.name, result.warnings = loaded.spec.name, list(loaded.warnings)
                result.spec, result.source = loaded.spec, loaded.source
        except ConfigError as e:
            result.issues = e.issues
        results.append(result)
    return results

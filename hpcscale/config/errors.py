"""Config errors as `file:line: key: message`, collected so one run reports every problem in a file."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from hpcscale.errors import BadInput

# The `file` of a problem in a command-line override (-p KEY=VALUE), which has no file or line.
COMMAND_LINE = "command line -p"


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem in one file: where it is and what is wrong."""

    file: str
    line: int | None
    key: str
    message: str

    def __str__(self) -> str:
        if self.file == COMMAND_LINE and self.key:  # command line -p train.params.lr: expected a number...
            return f"{self.file} {self.key}: {self.message}"
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(BadInput):
    """One or more ConfigIssues; exit code 2."""

    def __init__(self, issues: Iterable[ConfigIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest choice, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""

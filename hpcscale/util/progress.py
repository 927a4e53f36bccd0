"""Progress of long operations (hashing, staging): a silent base the library reports to, and a rich bar that
the CLI draws on a TTY (never in --json mode: stdout then carries one JSON document only)."""

from __future__ import annotations

import sys
import threading


class Progress:
    """What long work reports as it goes. Called from several threads; the base class ignores it."""

    def start(self, files: int, nbytes: int) -> None: ...

    def advance(self, files: int = 0, nbytes: int = 0) -> None: ...

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        pass


class RichProgress(Progress):
    """Files and bytes, with rate and time left, on stderr. A context manager."""

    def __init__(self, label: str):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as Bar

        self.bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.label = label
        self.lock = threading.Lock()
        self.files_task = self.bytes_task = None

    def __enter__(self) -> RichProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def start(self, files: int, nbytes: int) -> None:
        with self.lock:
            self.files_task = self.bar.add_task(f"{self.label} files", total=files)
            self.bytes_task = self.bar.add_task(f"{self.label} bytes", total=nbytes)

    def advance(self, files: int = 0, nbytes: int = 0) -> None:
        if self.files_task is None:
            return
        with self.lock:
            if files:
                self.bar.advance(self.files_task, files)
            if nbytes:
                self.bar.advance(self.bytes_task, nbytes)


def progress_for(label: str, as_json: bool) -> Progress:
    """A rich bar when stderr is a terminal and the output is not JSON; otherwise silence."""
    if as_json or not sys.stderr.isatty():
        return Progress()
    return RichProgress(label)

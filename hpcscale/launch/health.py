"""Health signals that act (docs/observability.md#health-signals): rank 0 asks the scheduler every
`health.poll_seconds` for warning signs of the job (hpcscale.slurm.health through the SchedulerView: a node
drained or failing, a reservation about to take a node, the time limit near) in a thread of its own, and the
step loop (hpcscale.launch.steploop) acts on what it found at the next step: each new sign logged once with its
evidence, and an immediate node-local checkpoint (when the job has that tier) on every rank, carried to them by
the stop check's all-reduce, at most once per `health.cooldown_seconds`.

A sign is new when its (kind, node, evidence) was not seen before in this attempt: a flapping state comes back
with other evidence at most, and the cooldown bounds the saves it can cause. What is remembered is bounded by
forgetting the oldest, never by refusing the new: a source (kind and node) keeps its newest SEEN_PER_SOURCE
evidences and at most SEEN_SOURCES sources are kept (the first seen longest ago forgotten first), so a node or
GPU whose evidence changes at every poll (a count that grows, a reason stamped with its time) can never hide a
first sign of another node or kind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["HealthWatch", "NoHealthWatch"]

# what a poller remembers (a scheduler answering nonsense forever cannot grow it without bound)
SEEN_PER_SOURCE = 8  # evidences of one (kind, node): a state that flaps between a few comes back as seen
SEEN_SOURCES = 8192  # (kind, node) pairs: a few kinds on each node of a job of thousands


class HealthWatch:
    """Rank 0's poller. `signs()` is the scheduler's reader: a list of {"kind", "node", "evidence"} dicts."""

    def __init__(self, signs: Callable[[], list[dict]] | None, *, poll_s: float, cooldown_s: float):
        self._signs = signs
        self.poll_s = poll_s
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._pending: list[dict] = []  # new signs the step loop has not logged yet
        self._due = False  # a new sign came since the last save it caused: a save is asked for
        self._saved_at = -float("inf")  # monotonic time of the last save a sign caused
        self._seen: dict[tuple, dict[object, None]] = {}  # (kind, node) -> its evidences (keys), oldest first
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0  # polls that failed (the scheduler did not answer): no sign, no error

    def start(self) -> HealthWatch:
        """Poll the scheduler in a thread of its own (with a reader and a period; else signs come by add())."""
        if self._signs is not None and self.poll_s > 0:
            self._thread = threading.Thread(target=self._run, name="hpcscale-health", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Ask once; keep the signs not seen before (the thread calls this every poll_s)."""
        try:
            found = self._signs() if self._signs is not None else []
        except Exception:  # the scheduler's trouble is no sign and must not end the poller
            self.errors += 1
            return
        self.add(found)

    def add(self, found: list[dict]) -> None:
        """Signs from elsewhere on rank 0 (the straggler verdict at a timing window), or the poller's. A sign
        is the same as one seen before when its kind, node and `key` (default: its evidence) are."""
        with self._lock:
            for sign in found:
                if not self._remember((sign.get("kind"), sign.get("node")), sign.get("key", sign.get("evidence"))):
                    continue
                self._pending.append(
                    {k: v for k, v in sign.items() if k not in ("key", "act")} | {"seen": round(time.time(), 3)}
                )
                self._due = self._due or sign.get("act", True)  # a sign that is only to be logged asks for no save

    def _remember(self, source: tuple, key: object) -> bool:
        """Whether `key` is new for `source`; remembered either way, the oldest forgotten past the bounds."""
        keys = self._seen.get(source)
        if keys is None:
            if len(self._seen) >= SEEN_SOURCES:
                del self._seen[next(iter(self._seen))]
            keys = self._seen[source] = {}
        elif key in keys:
            return False
        if len(keys) >= SEEN_PER_SOURCE:
            del keys[next(iter(keys))]
        keys[key] = None
        return True

    def wants_save(self) -> bool:
        """Whether a new sign asks for a checkpoint now: one came, and the cooldown since the last save it caused
        has passed (this rank's clock: its vote joins the others' in the stop check, and every rank saves)."""
        with self._lock:
            return self._due and time.monotonic() - self._saved_at >= self.cooldown_s

    def pending(self) -> bool:
        """Whether new signs wait to be taken (a rank other than 0 sends them to rank 0 to be logged)."""
        with self._lock:
            return bool(self._pending)

    def take(self) -> list[dict]:
        """The new signs, once each, oldest first."""
        with self._lock:
            out, self._pending = self._pending, []
            return out

    def saved(self) -> None:
        """A checkpoint for the signs so far was taken: the cooldown starts."""
        with self._lock:
            self._due = False
            self._saved_at = time.monotonic()


class NoHealthWatch:
    """Every rank but 0, and a job with no scheduler to ask (run --local) or `health.poll_seconds: 0`."""

    def wants_save(self) -> bool:
        return False

    def pending(self) -> bool:
        return False

    def take(self) -> list[dict]:
        return []

    def saved(self) -> None:
        pass

    def add(self, found: list[dict]) -> None:
        pass

    def stop(self) -> None:
        pass

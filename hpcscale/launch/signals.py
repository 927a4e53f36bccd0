"""Stop on request: SIGUSR1, SIGUSR2 and SIGTERM set a flag; ranks agree on it so all stop at the same step.

Slurm sends the job's `--signal` (default USR1, 120 s before the time limit) and SIGTERM on preemption or
scancel. The trainer finishes the step it is in, checkpoints (with the checkpoint issue), and the launcher
exits with STOPPED_EXIT_CODE so scripts and requeue logic can tell "stopped on request" from a failure.

`run --local` has no Slurm to deliver the signal to every rank, so its front end does (StopForwarder):
1. SIGTERM, SIGHUP or SIGINT (Ctrl-C) to the front end becomes SIGUSR2 to mpirun. mpirun forwards SIGUSR1 and
   SIGUSR2 to every rank (Open MPI's `ess_base_forward_signals` default) but takes SIGTERM, SIGINT and SIGHUP
   as "kill the job": SIGTERM 1 s before SIGKILL (`odls_base_sigkill_timeout`), too soon for a step and a
   checkpoint. mpirun runs in a session of its own (util/proc.Session), so a terminal's Ctrl-C reaches only
   the front end.
   Until every rank has its handler (rank 0 prints RANKS_READY after the bootstrap, which no rank passes
   before installing it), a stop is held, not forwarded: SIGUSR2 to a rank still starting up, or to mpirun
   before its own handler is set, would kill it instead of stopping it. A second signal meanwhile
   terminates the job as in 3.
2. The ranks stop as above and exit 75; mpirun exits 75.
3. If they have not within the grace (the job's `timeout_seconds` + STOP_SAVE_S), or the user signals again,
   mpirun gets SIGTERM (it kills its ranks); KILL_AFTER_S later, or at a third signal, every process of the
   session gets SIGKILL. Either way the command still exits 75: the stop was requested, and the newest
   checkpoint that verifies is where a resume starts.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable

from hpcscale.errors import STOPPED_EXIT_CODE
from hpcscale.util.proc import Session

__all__ = [
    "FORWARDED_STOP",
    "FRONT_END_SIGNALS",
    "RANKS_READY",
    "STOPPED_EXIT_CODE",
    "STOP_SIGNALS",
    "StopFlag",
    "StopForwarder",
    "StopRequested",
]
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
FRONT_END_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
FORWARDED_STOP = signal.SIGUSR2  # mpirun forwards it to every rank; USR1 stays Slurm's time-limit warning
STOP_SAVE_S = 120.0  # on top of timeout_seconds: the stop step's checkpoint
KILL_AFTER_S = 10.0  # from SIGTERM to mpirun to SIGKILL of the whole session
# Printed by rank 0 once every rank has passed the bootstrap (and so installed its stop handler).
RANKS_READY = "hpcscale launch: every rank is up; stop signals armed"
# Printed by rank 0 once every rank saved the stop's checkpoint: the ranks exit 75 next.
STOP_LINE = "stop requested: stopping after step"


class StopRequested(Exception):
    """Raised by entry points (or the trainer) to end a run cleanly after a stop request."""


class StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.at: float | None = None  # time.monotonic() of the first stop signal: how much grace a stop used

    @property
    def requested(self) -> bool:
        """Whether this rank received a stop signal (use Context.should_stop() to agree across ranks)."""
        return self.signal is not None

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.signal = signum
        if self.at is None:
            self.at = time.monotonic()


_EXITED = object()
_READY = object()


class StopForwarder:
    """The front end's side of a stop (see the module docstring). Use as a context manager around the run:

        with StopForwarder(grace_s=..., notify=...) as fwd:   # handlers installed before mpirun starts
            child = Session(args)
            fwd.watch(child)
            ...read child's output...
        fwd.requested, fwd.forced

    The signal handler only puts the signal number in a SimpleQueue (documented as safe from a handler); a
    thread does the rest, so nothing in a handler writes to a stream or takes a lock the main thread may hold.
    The thread blocks these signals, so the kernel delivers them to the main thread, whose blocking read of
    mpirun's output they interrupt: a silent run still reacts at once. The thread also notices mpirun's exit
    and kills whatever it left in its session, so the output pipe reaches its end.
    """

    def __init__(self, *, grace_s: float, notify: Callable[[str], None], kill_after_s: float = KILL_AFTER_S):
        self.grace_s = grace_s
        self.kill_after_s = kill_after_s
        self.notify = notify
        self.requested: str | None = None  # the first signal's name
        self.forced = False  # the ranks were terminated rather than stopped
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._old: dict[int, object] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()  # every rank can take a forwarded stop (RANKS_READY was seen)

    def mark_ready(self) -> None:
        """The ranks printed RANKS_READY: a held stop is forwarded now."""
        self._ready.set()
        self._events.put(_READY)

    def __enter__(self) -> StopForwarder:
        for sig in FRONT_END_SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        # `hpcscale run` held them since its start (hpcscale.cli.entry): one that came meanwhile is handled now,
        # and nothing started from here on (mpirun) inherits them held
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FRONT_END_SIGNALS)
        return self

    def stop_watching(self) -> None:
        """End the forwarder thread. Call before reaping mpirun: once reaped, its pid may be reused, and the
        thread must never signal a stranger. Signals that come later are still recorded (`requested`)."""
        if self._thread is not None:
            self._events.put(_EXITED)
            self._thread.join()
            self._thread = None

    def __exit__(self, *_exc) -> None:
        self.stop_watching()
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, _frame) -> None:
        self._events.put(signum)

    def watch(self, child: Session) -> None:
        # Started with the signals blocked so the thread inherits the mask; unblocked again here at once.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FRONT_END_SIGNALS)
        try:
            self._thread = threading.Thread(target=self._run, args=(child,), name="stop-forwarder", daemon=True)
            self._thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def _run(self, child: Session) -> None:
        stage = 0  # 0 running, 1 stop forwarded, 2 mpirun terminated, 3 session killed
        deadline = None
        while True:
            if child.exited():
                child.kill_all(signal.SIGKILL)  # what mpirun left behind, so the pipe reaches its end
                return
            wait = 0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic()))
            try:
                event = self._events.get(timeout=wait)
            except queue.Empty:
                if deadline is None or time.monotonic() < deadline:
                    continue
                event = None  # the deadline passed
            if event is _EXITED:
                return
            if event is _READY:
                if stage == 0 and self.requested is not None:  # a stop held during start-up goes out now
                    child.send(FORWARDED_STOP)
                    stage, deadline = 1, time.monotonic() + self.grace_s
                continue
            if stage == 0 and event is not None and self.requested is None:
                self.requested = signal.Signals(event).name
                if self._ready.is_set():
                    child.send(FORWARDED_STOP)
                    stage, deadline = 1, time.monotonic() + self.grace_s
                    self.notify(
                        f"hpcscale run: {self.requested}: asking every rank to stop after its current step "
                        f"(checkpoint, exit 75); signal again to stop now"
                    )
                else:
                    deadline = time.monotonic() + self.grace_s
                    self.notify(
                        f"hpcscale run: {self.requested}: the ranks are still starting; they will be asked to "
                        "stop as soon as they are up (signal again to stop now)"
                    )
            elif stage == 0:  # a second signal, or the grace ran out, before the ranks were up
                stage = 1
                self._events.put(event)
            elif stage == 1:
                why = f"ranks did not stop within {self.grace_s:.0f}s" if event is None else "signalled again"
                self.forced = True
                child.send(signal.SIGTERM)
                self.notify(f"hpcscale run: {why}: terminating the ranks (progress since the last checkpoint is lost)")
                stage, deadline = 2, time.monotonic() + self.kill_after_s
            elif stage == 2:
                killed = child.kill_all(signal.SIGKILL)
                self.notify(f"hpcscale run: killed {len(killed)} process(es) of the run")
                stage, deadline = 3, None

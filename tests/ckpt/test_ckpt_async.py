"""The async save's writer thread (hpcscale.ckpt.tier): what it keeps after a save, what reaches the
training thread when a save raises, and that a dead or closed thread makes the caller raise, never wait.

In one process, on a real gloo group of one rank and real files. A call that could block is made through
`_within`, so a regression fails the test instead of hanging it."""

from __future__ import annotations

import ctypes
import gc
import threading
import traceback
import weakref

import pytest
import torch

from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.ckpt.tier import _Background
from hpcscale.errors import RuntimeFailure
from hpcscale.layout import ParallelDims

LIMIT_S = 20.0  # a save of these few KiB takes milliseconds; a dead thread is noticed within POLL_S


def _manager(root) -> CheckpointManager:
    return CheckpointManager(root, dims=ParallelDims(pp=1, dp=1, tp=1), rank=0)


def _within(fn, *args):
    """fn(*args) on a helper thread, which must finish within LIMIT_S; its result or its exception."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # KeyboardInterrupt and SystemExit are what some tests expect
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(LIMIT_S)
    assert not t.is_alive(), f"{fn.__qualname__} still blocked after {LIMIT_S} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _new_writer_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hpcscale-ckpt-0" and t not in before]


def _raise_in(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Make `exc` raise in `thread` at its next Python instruction, as a signal does in the main thread."""
    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    assert set_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc)) == 1


@pytest.mark.parametrize("defer_staging", [False, True])
def test_a_finished_save_leaves_nothing_of_it_on_the_writer_thread_and_close_ends_it(group, tmp_path, defer_staging):
    """The idle thread may wait for the next save a long time (or forever, after the last one): a save's
    arguments, which reach the live tensors (a model's, on an accelerator too), must be let go once it is
    done. close() then ends the thread, and closing again, or closing a manager that never saved
    asynchronously, does nothing."""
    before = set(threading.enumerate())
    m = _manager(tmp_path / "a")
    w = torch.randn(256, 256)
    gone = weakref.ref(w)
    m.save(1, {"w": w}, {"step": 1}, asynchronous=True, defer_staging=defer_staging)
    _within(m.wait)
    assert m.last_step == 1
    del w
    gc.collect()
    assert gone() is None, "the writer thread still holds the saved tensor"
    (thread,) = _new_writer_threads(before)
    assert thread.is_alive()
    _within(m.close)
    assert not thread.is_alive()
    _within(m.close)
    with pytest.raises(RuntimeFailure, match="closed"):
        m.save(2, {"w": torch.ones(4)}, {"step": 2}, asynchronous=True)
    with pytest.raises(RuntimeFailure, match="closed"):
        m.save(2, {"w": torch.ones(4)}, {"step": 2}, asynchronous=True, defer_staging=True)
    _within(m.wait_staged)  # a save refused before it was handed over leaves nothing to wait for
    m.save(2, {"w": torch.ones(4)}, {"step": 2}, asynchronous=False)  # the caller's own thread: still works
    assert m.last_step == 2
    never = _manager(tmp_path / "b")
    _within(never.close)
    _within(never.close)
    assert _new_writer_threads(before) == []


class _ExitsWhenCopied(torch.Tensor):
    """A tensor whose copy for a save raises SystemExit, in whichever thread takes the copy."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            raise SystemExit(3)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_system_exit_in_a_background_save_is_raised_by_the_next_wait(group, tmp_path):
    """A deferred save copies the tensors on the writer thread; what the copy raises, a BaseException
    included, is raised by wait() in the caller, and the thread goes on to commit the next save."""
    before = set(threading.enumerate())
    m = _manager(tmp_path)
    m.save(1, {"w": torch.ones(64).as_subclass(_ExitsWhenCopied)}, {"step": 1}, asynchronous=True, defer_staging=True)
    _within(m.wait_staged)
    with pytest.raises(SystemExit):
        _within(m.wait)
    assert m.last_step is None
    m.save(2, {"w": torch.ones(64)}, {"step": 2}, asynchronous=True, defer_staging=True)
    _within(m.wait)
    assert m.last_step == 2
    (thread,) = _new_writer_threads(before)
    _within(m.close)
    assert not thread.is_alive()


def test_a_failed_save_kept_for_the_next_wait_holds_none_of_its_tensors(group, tmp_path):
    """The error of a background save waits for the training thread's next wait(), which may come a whole
    checkpoint interval later: its traceback must not keep the tensors of the save alive meanwhile."""
    m = _manager(tmp_path)
    w = torch.ones(4096).as_subclass(_ExitsWhenCopied)
    gone = weakref.ref(w)
    m.save(1, {"w": w}, {"step": 1}, asynchronous=True, defer_staging=True)
    _within(m.wait_staged)
    _within(m._bg.join)  # the thread is idle again: the error is kept, not yet raised
    del w
    gc.collect()
    assert gone() is None, "the failed save's error still holds the tensor"
    with pytest.raises(SystemExit) as failed:
        _within(m.wait)
    assert "_stage_and_write" in "".join(traceback.format_tb(failed.value.__traceback__))  # still readable
    _within(m.close)


@pytest.mark.parametrize("escaping", [KeyboardInterrupt, SystemExit])
def test_a_base_exception_escaping_a_job_is_kept_for_the_caller_and_the_thread_lives_on(escaping):
    """The manager's jobs catch their own errors; whatever gets past one (an interrupt, an exit) must
    not end the thread silently with the job unfinished: join() returns, the error is handed over, and the
    next job runs on the same thread."""
    bg = _Background("hpcscale-ckpt-test", 0)
    ran = []

    def job(n):
        ran.append(n)
        raise escaping()

    bg.submit(job, 1)
    _within(bg.join)
    assert isinstance(bg.take_error(), escaping) and bg.take_error() is None
    bg.submit(ran.append, 2)
    _within(bg.join)
    assert ran == [1, 2] and bg.take_error() is None
    (thread,) = [t for t in threading.enumerate() if t.name == "hpcscale-ckpt-test"]
    _within(bg.close)
    assert not thread.is_alive()


# The thread's death is this test's doing: pytest's report of an exception in a thread is expected here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("defer_staging", [False, True])
def test_a_dead_writer_thread_makes_the_caller_raise_instead_of_waiting(group, tmp_path, defer_staging):
    """If the thread dies anyway (here: SystemExit raised into it while it waits for a job, outside any job),
    the save handed to it can never finish. wait_staged() and wait() must say so rather than block (the
    trainer waits with the hang watchdog paused), and so must every later asynchronous save; a synchronous
    save, on the caller's thread, still commits."""
    before = set(threading.enumerate())
    m = _manager(tmp_path)
    state = {"w": torch.randn(64, 64)}
    m.save(1, state, {"step": 1}, asynchronous=True)
    _within(m.wait)
    (thread,) = _new_writer_threads(before)
    _raise_in(thread, SystemExit)  # delivered when the save below wakes it
    state["w"].add_(1.0)
    m.save(2, state, {"step": 2}, asynchronous=True, defer_staging=defer_staging)
    if defer_staging:
        with pytest.raises(RuntimeFailure, match="died of SystemExit"):
            _within(m.wait_staged)
    with pytest.raises(RuntimeFailure, match="died of SystemExit"):
        _within(m.wait)
    assert not thread.is_alive() and m.last_step == 1
    with pytest.raises(RuntimeFailure, match="died of SystemExit"):
        _within(lambda: m.save(2, state, {"step": 2}, asynchronous=True))
    m.save(2, state, {"step": 2}, asynchronous=False)
    assert m.last_step == 2
    _within(m.close)

"""How hpcscale starts Python: never with the working directory on the import path.

`python -m hpcscale` and `python -c CODE` put the directory they start in first on sys.path (its absolute path
for -m, '' for -c), ahead of the standard library and site-packages: a `yaml.py` or `json.py` left where the
user stands, or in a run directory a colleague can write (Slurm starts the ranks there), would run as the user
in every rank. Python 3.11's `-P` (PYTHONSAFEPATH) leaves that entry out, but hpcscale supports 3.10; `-I`
would also drop PYTHONPATH, where users' entry modules come from (`train.entry: module:function`). The
console script `hpcscale` is clean (its sys.path[0] is its own bin directory), but the one on PATH may belong
to another installation than the interpreter the front end runs in. So every Python process hpcscale starts
(mpirun's ranks, doctor's probes, the staging agent) is `python -c` with SAFE_PATH first, which, before
anything is imported from a path:

1. drops every relative sys.path entry: -c's '' and, where the interpreter has not made them absolute (3.10
   and older under -S), PYTHONPATH's empty and relative entries;
2. imports os: already loaded by site, frozen on 3.11+, or else found in the standard library, since no
   relative entry is left;
3. drops the entries Python made absolute from PYTHONPATH's empty or relative entries (`:/a`, `.`, `src`: each
   names the working directory or a place under it), unless PYTHONPATH also names that directory by its
   absolute path.

What stays is PYTHONPATH's absolute entries, the standard library and site-packages (with what .pth files
add). SAFE_PATH alone is not enough where site runs: site makes PYTHONPATH's relative entries absolute and
then runs the `import` lines of .pth files, before any -c code, so a threading.py where the user stands runs
at start-up. The environment a child gets therefore carries PYTHONPATH's absolute entries only
(`child_env`; the rendered sbatch script does the same for its ranks). `clean_import_path` applies SAFE_PATH
to a process that is already running (a rank started by a user's own batch script through the console script).

SAFE_PATH is one line of Python 3.8+ with the standard library only: the staging agent runs it on other
sites' python3 (hpcscale.xsite.bootstrap). Stdlib only here too: every layer may import this.

The rest is what a process's start and end cost: the cyclic collector paused while a rank imports torch and the
rest (`pause_collector`, `resume_collector`) or while any command does (`load_paused`), and the end of a
command without the interpreter's teardown (`exit_now`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Mapping, Sequence

SAFE_PATH = (
    "import sys;"
    "sys.path[:]=[p for p in sys.path if p[:1]=='/'];"
    "import os;"
    "_e=None if sys.flags.ignore_environment else os.environ.get('PYTHONPATH');"
    "_e=_e.split(os.pathsep) if _e else [];"
    "_d={os.path.abspath(x) for x in _e if not os.path.isabs(x)}-{os.path.abspath(x) for x in _e if os.path.isabs(x)};"
    "sys.path[:]=[p for p in sys.path if p not in _d];"
    "del _e,_d;"
)

# `python -c ... hpcscale ARGS`: sys.argv is then ['-c', 'hpcscale', ARGS...]; the command line reads as
# `hpcscale ARGS` to click, and to ps / pgrep -f 'hpcscale launch --run-dir RUN'.
_RUN_HPCSCALE = "del sys.argv[0];from hpcscale.cli.entry import main;main()"


def absolute_entries(pythonpath: str) -> str:
    """PYTHONPATH's absolute entries, in order: its empty and relative ones name the working directory."""
    return os.pathsep.join(e for e in pythonpath.split(os.pathsep) if os.path.isabs(e))


def child_env(env: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env`, what a child gets on top of `environ`, with the PYTHONPATH it ends up with (env's, else environ's)
    cut to its absolute entries (an empty PYTHONPATH is no PYTHONPATH to Python)."""
    out = dict(env)
    pythonpath = env.get("PYTHONPATH", environ.get("PYTHONPATH"))
    if pythonpath is not None:
        out["PYTHONPATH"] = absolute_entries(pythonpath)
    return out


def python_command(code: str, *args: str) -> list[str]:
    """This interpreter running `code` after SAFE_PATH, `args` as its sys.argv[1:]."""
    return [sys.executable, "-c", SAFE_PATH + code, *args]


def hpcscale_command(*args: str) -> list[str]:
    """`hpcscale ARGS` run by this interpreter (the hpcscale the front end runs), importing nothing from the
    working directory."""
    return python_command(_RUN_HPCSCALE, "hpcscale", *args)


def clean_import_path() -> None:
    """SAFE_PATH applied to this process's sys.path (the same code its children run first)."""
    exec(SAFE_PATH, {})  # a constant of this module: the very code the children run


# ---- the cyclic garbage collector during a rank's start-up ------------------------------------------------------
_paused = False


def pause_collector() -> None:
    """Turn Python's cyclic garbage collector off for a process's start-up imports, until `resume_collector`.

    Importing torch, its distributed packages and mpi4py makes about 470,000 objects that live as long as the
    process, and the collector, left on, walks the growing heap again at each of its full passes: about a fifth
    of the CPU a rank's start-up imports take (scripts/bench/rank_start.py). Imports make little garbage that
    reference counting does not free at once. A collector someone else turned off stays off."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_collector() -> None:
    """End `pause_collector`: freeze what is alive now (modules, their functions and classes: what a process keeps
    to its end), so no later collection walks it again, and turn the collector back on. A full pass over a rank's
    imports takes 0.2 s of CPU here, a pause every other rank then waits for at its next collective; after the
    freeze, what is imported later (torch._dynamo, which the first optimizer imports; the user's modules) and the
    training loop's collections walk only their own objects. What the imports left in reference cycles (about
    9,000 objects, a few MiB) is frozen with the rest: freeing it would cost that 0.2 s pass."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False


# a module's own loader, made for it by the path finder (a zip archive's loader serves all of its modules)
_FILE_LOADERS = (
    importlib.machinery.SourceFileLoader,
    importlib.machinery.SourcelessFileLoader,
    importlib.machinery.ExtensionFileLoader,
)


class _LoadedPaused:
    """A meta path finder that finds nothing itself: for one of its names, the spec the finders after it give,
    the module's code run with the collector off, what is alive after frozen and the collector back on (as a
    rank's start-up). It leaves sys.meta_path at the first of its names asked for: that import loads the rest."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if not isinstance(spec.loader, _FILE_LOADERS):  # one loader per module: patched alone
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            was_on = gc.isenabled()  # off already: a rank's start-up, or someone else's choice
            gc.disable()
            try:
                run(module)
            finally:
                if was_on:
                    gc.freeze()
                    gc.enable()

        spec.loader.exec_module = exec_module  # this module's own loader: torch's package, nothing else
        return spec


def load_paused(*names: str) -> None:
    """From now on, the first import of any of `names` in this process runs with the collector paused and its
    objects frozen after (`_LoadedPaused`). The console script asks it for torch, which a command loads for part
    of its work (a cross-site tick that handles tensors, `ckpt export`): its import takes about 1.2 s of CPU with
    the collector on, 0.2 s of it the collector walking the growing heap. Nothing happens for a name already
    loaded, and a name found by another kind of loader than a file's (a zip archive's) is loaded as usual."""
    wanted = [n for n in names if n not in sys.modules]
    if wanted and not any(isinstance(f, _LoadedPaused) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoadedPaused(wanted))


# ---- the end of a process ------------------------------------------------------------------------------------
def finish(*, join_threads: bool = True) -> None:
    """The visible part of the interpreter's exit, in its order: threading's exit hooks and a join of every
    non-daemon thread (an executor left open finishes its work; `join_threads`), the atexit handlers (logging's
    flush among them), a collection (the finalizers of objects in unreachable cycles run, as at the ordinary exit),
    MPI_Finalize where mpi4py initialized MPI (mpi4py registers it below Python's atexit, where os._exit does
    not reach, and mpirun reports a rank that exits without it), stdout and stderr flushed (what a flush raises
    is raised). What is left of the exit is the teardown: the caller's os._exit skips it."""
    if join_threads:
        threading._shutdown()  # what Py_Finalize calls first; idempotent
    atexit._run_exitfuncs()  # runs each handler once, then clears them
    gc.collect()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        with contextlib.suppress(Exception):
            mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_now(code: int) -> None:
    """`finish`, then out at once without the interpreter's teardown. Where a step cannot run (a failed flush, a
    Python without threading._shutdown, a call off the main thread), this returns and the ordinary exit follows."""
    if getattr(threading, "_shutdown", None) is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        finish()
    except BaseException:
        return
    os._exit(code)

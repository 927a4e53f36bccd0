"""What `ssh HOST python3 -S -c BOOT ROLE ROOT` runs, and the bytes sent right behind it: the staging agent.

The remote side has nothing of hpcscale installed. BOOT (a few lines, passed on the command line) reads from
fd 0, as length-prefixed blobs (a 10-digit length and a newline, then the bytes):

  1. the bytecode magic number of the local python;
  2. the code of every module in AGENT_MODULES, compiled here (marshal);
  3. their names, one a line, in AGENT_MODULES order;
  4. one blob per module: its source.

A remote python with the same magic number (the same minor version, as for .pyc files) runs the compiled
code, saving the compile on the critical path of every connection; any other compiles the sources.
Each module is then installed under its own name in sys.modules (its parent packages created empty) and
executed, in AGENT_MODULES order, so that `from hpcscale.portable.wire import send` in one of them finds the
module installed before it; last, BOOT calls the agent's `main`. The installed packages hide any hpcscale of
the remote's own: an import of a module that was not shipped fails rather than finding another version.

Invariant: the bytes shipped are read from this installation's own files, the same modules the local side
imports (no second copy to drift); tests/stage/test_portable.py checks that AGENT_MODULES holds every hpcscale
module the agent imports, each after the modules it imports. Unbuffered reads of exactly these bytes:
requests sent right behind (without waiting for the agent's hello) must stay in the pipe for the agent, not
in a buffered reader's read-ahead. Everything goes out in one write with the first requests: one round trip.

Kept light on imports: channel.py imports this before ssh starts.
"""

from __future__ import annotations

import functools
import os

from hpcscale.util.pystart import SAFE_PATH

# In the order they are executed remotely: each after every module it imports. The last one is the agent.
AGENT_MODULES = (
    "hpcscale.portable.errors",
    "hpcscale.portable.files",
    "hpcscale.portable.hashing",
    "hpcscale.portable.paths",
    "hpcscale.portable.threads",
    "hpcscale.portable.wire",
    "hpcscale.portable.source",
    "hpcscale.portable.lock",
    "hpcscale.portable.journal",
    "hpcscale.portable.sink",
    "hpcscale.xsite.agent",
)

# SAFE_PATH first: the agent runs in the remote home (ssh's working directory) and under -S imports even os
# through sys.path, whose first entry is -c's '' (hpcscale.util.pystart)
BOOT = SAFE_PATH + (
    "\nimport os,sys,marshal\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:raise SystemExit(1)\n"
    "  b+=c\n"
    " return b\n"
    "def g():return r(int(r(11)))\n"
    "m,c,n=g(),g(),g().decode().split()\n"
    "s=[g() for x in n]\n"
    "try:\n"
    " import _frozen_importlib_external as e;k=e.MAGIC_NUMBER\n"
    "except Exception:k=None\n"
    "c=marshal.loads(c) if m==k else [compile(x,y,'exec') for x,y in zip(s,n)]\n"
    "def p(x):\n"
    " d=sys.modules.get(x)\n"
    " if d is None:\n"
    "  d=sys.modules[x]=type(sys)(x);d.__path__=[];a,_,b=x.rpartition('.')\n"
    "  if a:setattr(p(a),b,d)\n"
    " return d\n"
    "for x,y in zip(n,c):\n"
    " d=sys.modules[x]=type(sys)(x);a,_,b=x.rpartition('.');setattr(p(a),b,d);exec(y,d.__dict__)\n"
    "d.main(sys.argv)"
)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds hpcscale/


def module_path(name: str) -> str:
    """The source file of one of AGENT_MODULES in this installation."""
    return os.path.join(_ROOT, *name.split(".")) + ".py"


def frame(blob: bytes) -> bytes:
    """One blob as BOOT reads it: a 10-digit length, a newline, the bytes."""
    return b"%010d\n" % len(blob) + blob


def agent_sources() -> list[tuple[str, bytes]]:
    """(module name, source) of every module shipped, in AGENT_MODULES order."""
    out = []
    for name in AGENT_MODULES:
        with open(module_path(name), "rb") as f:
            out.append((name, f.read()))
    return out


def boot_input(magic: bytes, code: bytes, sources: list[tuple[str, bytes]]) -> bytes:
    """What BOOT reads, from its parts (the tests build one with a foreign magic number)."""
    names = "\n".join(name for name, _ in sources).encode()
    return b"".join(frame(blob) for blob in (magic, code, names, *(source for _, source in sources)))


@functools.cache
def agent_blobs() -> bytes:
    """What BOOT reads for this python: built once per process, however many streams."""
    import marshal
    from importlib.util import MAGIC_NUMBER

    sources = agent_sources()
    code = marshal.dumps([compile(source, name, "exec", dont_inherit=True) for name, source in sources])
    return boot_input(MAGIC_NUMBER, code, sources)

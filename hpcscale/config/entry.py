"""Is `train.entry` (`package.module:function`) there, without importing it (nor torch, which it surely imports)?

The module is looked up the way `import` would on the ranks' path: the absolute entries of the job's and the
site's PYTHONPATH, then this interpreter's sys.path less the working directory (the ranks never import from
the directory they start in, nor through PYTHONPATH's empty or relative entries: hpcscale.util.pystart);
package by package with importlib's PathFinder, so no parent package's `__init__` runs. A source file found
is scanned (ast) for a top-level name `function`: a `def`, a class, an assignment or an import. Not found
on this machine: a warning (the compute nodes may have it); found without the function: an error, the job
would fail at start-up.
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def entry_problem(entry: str, pythonpath: list[str]) -> tuple[str, str] | None:
    """('error' | 'warning', message) about `entry`, or None when the function is defined where it is looked for."""
    module, _, func = entry.partition(":")
    spec = _find(module, [*(p for p in pythonpath if os.path.isabs(p)), *_interpreter_path()])
    if spec is None:
        where = ", ".join(dict.fromkeys(p for p in pythonpath if os.path.isabs(p))) or "none"
        ignored = [p for p in dict.fromkeys(pythonpath) if not os.path.isabs(p)]
        hint = f"; its relative entries ({', '.join(ignored)}) are ignored" if ignored else ""
        if _find(module, [os.getcwd()]) is not None:
            hint += (
                f"; it is in the working directory, which the ranks never import from: put {os.getcwd()} in PYTHONPATH"
            )
        return "warning", (
            f"module '{module}' is not found on this machine (searched the absolute entries of the job's and site's "
            f"PYTHONPATH ({where}) and this Python's path{hint}); the ranks import it at start-up: make it "
            "importable there"
        )
    origin = spec.origin
    if not origin or not origin.endswith(".py"):
        return None  # an extension module or a namespace: nothing to scan
    try:
        tree = ast.parse(Path(origin).read_bytes(), filename=origin)
    except (OSError, SyntaxError, ValueError) as e:
        return "error", f"module '{module}' ({origin}) cannot be read or parsed: {e}"
    names = _top_level_names(tree)
    if func in names or "*" in names or "__getattr__" in names:  # star imports and PEP 562: cannot tell
        return None
    close = difflib.get_close_matches(func, sorted(names), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return "error", f"module '{module}' ({origin}) defines no top-level '{func}'{hint}"


def _interpreter_path() -> list[str]:
    """This interpreter's sys.path as the ranks have it: without the working directory, whether it came in as
    sys.path[0] (python -m, python -c) or through this process's own PYTHONPATH's empty or relative entries."""
    here = os.getcwd()
    own = os.environ.get("PYTHONPATH", "")
    from_here = {here} | {os.path.abspath(e) for e in own.split(os.pathsep) if own and not os.path.isabs(e)}
    return [p for p in sys.path if os.path.isabs(p) and p not in from_here]


def _find(module: str, search: list[str]):
    """The module's spec, found package by package without running any package's __init__; None if absent."""
    parts = module.split(".")
    path: list[str] | None = search
    spec = None
    for i, part in enumerate(parts):
        spec = importlib.machinery.PathFinder.find_spec(part, path)
        if spec is None and i == 0:
            try:  # installed through a meta-path finder (an editable install): a top-level lookup imports nothing
                spec = importlib.util.find_spec(part)
            except (ImportError, ValueError):
                spec = None
        if spec is None:
            return None
        if i < len(parts) - 1:
            path = list(spec.submodule_search_locations or [])
            if not path:
                return None  # a plain module has no submodules
    return spec


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / `try: import x except ...`
            names |= _top_level_names(ast.Module(body=[*node.body, *getattr(node, "orelse", [])], type_ignores=[]))
    return names

"""The layering rule (docs/architecture.md), enforced: every import in hpcscale/ runs down the layers, never up,
and no set of modules imports itself in a circle. Imports inside functions count: a lazy import is still a
dependency, only a later one. No exceptions list: a new upward import fails here, and the fix is to move the
shared rule down a layer, not to add it to a list.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hpcscale"

# Lowest first. A unit is a subpackage (hpcscale/ckpt/) or a top-level module (hpcscale/layout.py); "" is the
# package's own __init__ (the version). Each unit may import only itself and units listed before it.
LAYERS = [
    "",  # hpcscale/__init__.py: the version string
    "portable",  # stdlib-only pieces the staging agent ships to other sites (hashing, path rules, wire protocol)
    "errors",  # the exit-code contract
    "util",  # small utilities; pure parsers of Slurm notation (hostlists, times); subprocess calls
    "layout",  # (pp, dp, tp): degrees, rank order, coordinates and their rules; torch-free
    "config",  # site configs and job specs: schemas, YAML loading, validation with file:line: key
    "topology",  # switch trees and the placement search: pure math
    "data",  # manifests, token datasets, the deterministic loader
    "rundir",  # the run directory's layout: job.yaml, site.yaml, submissions, logs, metrics, checkpoints
    "ckpt",  # checkpoint format, writer, reader, verify
    "xsite",  # staging transports (and, later, cross-site rounds)
    "observe",  # what a run recorded, read back: per-rank timing and stragglers, checkpoint interval, reports
    "slurm",  # render, sbatch/squeue/sacct/scontrol, the switch tree of a live site
    "parallel",  # torch-native TP / PP / DP applied to a model
    "launch",  # rank bootstrap, signals, the Context handed to entry points
    "recovery",  # the scheduler's side of a job's end: resume on a login node, the batch script's requeue decision
    "train",  # the reference GPT and its trainer: an entry point like a user's
    "smoke",  # `hpcscale smoke`: real jobs that check new nodes, judged from their run directories
    "doctor",  # checks every layer below
    "cli",  # click commands: parse, call the library, render
    "__main__",
]


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The hpcscale modules `module` imports anywhere in its file (the most specific known name for each)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names] + [target]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    # `from hpcscale.x import y` also names hpcscale.x; keep only the deepest module per import
    return {n for n in found if not any(o.startswith(n + ".") for o in found) or n in {"hpcscale"}}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()}
    assert units <= set(LAYERS), f"add to LAYERS (and docs/architecture.md): {sorted(units - set(LAYERS))}"


def test_imports_run_down_the_layers():
    rank = {u: i for i, u in enumerate(LAYERS)}
    upward = []
    for module, targets in _graph().items():
        for target in targets:
            if rank[_unit(target)] > rank[_unit(module)]:
                upward.append(f"{module} imports {target} ({_unit(module) or 'hpcscale'} < {_unit(target)})")
    assert not upward, "imports up the layers:\n" + "\n".join(sorted(upward))


# The rank side (launch/, parallel/, train/) imports nothing of the scheduler: what a rank may read of it (the
# switch tree it is placed on, where its job's logs go) is handed in by `hpcscale launch`
# (hpcscale.launch.scheduler.SchedulerView). Submitting, requeueing, cancelling and reading a job's state belong
# to the login side (slurm/ and recovery/), above it.
RANK_SIDE = ("launch", "parallel", "train")


def test_the_rank_side_reads_the_allocation_and_no_more_of_the_scheduler():
    reaching = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if _unit(module) in RANK_SIDE
        for target in targets
        if _unit(target) in ("slurm", "recovery")
    )
    assert not reaching, "the rank side reaching into the scheduler's side:\n" + "\n".join(reaching)


def test_no_import_cycles():
    graph = _graph()
    # The package __init__ runs before any submodule; its edges to children are not cycles.
    graph = {m: {t for t in ts if not m.startswith(t + ".") and t != "hpcscale"} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_portable_is_standard_library_only():
    """What ships to another site's bare python3 imports nothing but the standard library and itself
    (optional hash modules are imported inside try blocks and reported when missing)."""
    bad = []
    for path in sorted((PACKAGE / "portable").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    top = name.split(".")[0]
                    if node.__class__ is ast.ImportFrom and node.level:
                        continue
                    if (top == "hpcscale" and not name.startswith("hpcscale.portable")) or (
                        top not in sys.stdlib_module_names and top not in {"hpcscale", "xxhash", "blake3"}
                    ):
                        bad.append(f"{path.name}: {name}")
    assert not bad, bad


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The walker itself: a module in a low layer importing a high one is reported."""
    fake = tmp_path / "hpcscale"
    (fake / "util").mkdir(parents=True)
    (fake / "cli").mkdir()
    for p in (fake / "__init__.py", fake / "util" / "__init__.py", fake / "cli" / "__init__.py"):
        p.write_text("")
    (fake / "cli" / "main.py").write_text("from hpcscale.util import helper\n")
    (fake / "util" / "helper.py").write_text("def f():\n    from hpcscale.cli.main import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    try:
        test_imports_run_down_the_layers()
    except AssertionError as e:
        assert "hpcscale.util.helper imports hpcscale.cli.main" in str(e)
    else:
        raise AssertionError("an upward import inside a function went unnoticed")
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "hpcscale.cli.main <-> hpcscale.util.helper" in str(e)
    else:
        raise AssertionError("a cycle went unnoticed")

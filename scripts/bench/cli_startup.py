#!/usr/bin/env python3
"""CLI start-up on a login node: `hpcscale --help` and `hpcscale render` beside `python -c "import torch"`.

Each command runs N times in fresh processes, measured side by side in one run (this machine is noisy;
the ratios hold). Also proves torch is never imported by those commands (python -X importtime).

    python scripts/bench/cli_startup.py [-n 15] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET_S = 0.3


def timed(cmd: list[str], n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
        times.append(time.perf_counter() - t)
    return times


def imports_torch(code: str) -> bool:
    """Whether running `code` imports torch, read from python -X importtime (the torch row is the control)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, cwd=REPO)
    return any(line.rstrip().endswith("| torch") for line in out.stderr.splitlines())


def _cli_code(args: list[str]) -> str:
    return f"import sys; from hpcscale.cli.main import cli; sys.argv = ['hpcscale', *{args!r}]; cli()"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    exe = shutil.which("hpcscale") or sys.exit("hpcscale is not on PATH (pip install -e .)")
    job = str(REPO / "docs" / "examples" / "gpt-dgx.yaml")  # a file-topology site: no Slurm needed
    cases = {
        "hpcscale --help": ([exe, "--help"], _cli_code(["--help"])),
        "hpcscale render": (
            [exe, "render", job, "--run-dir", "/runs/b"],
            _cli_code(["render", job, "--run-dir", "/runs/b"]),
        ),
        'python -c "import torch"': ([sys.executable, "-c", "import torch"], "import torch"),
    }
    # Interleave the commands so drift on a shared machine hits all of them alike.
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(a.n):
        for name, (cmd, _) in cases.items():
            samples[name] += timed(cmd, 1)
    rows = []
    torch_median = statistics.median(samples['python -c "import torch"'])
    for name, (_, code) in cases.items():
        is_control = code == "import torch"
        med = statistics.median(samples[name])
        rows.append(
            {
                "command": name,
                "median_s": round(med, 4),
                "min_s": round(min(samples[name]), 4),
                "vs_import_torch": round(med / torch_median, 3),
                "imports_torch": imports_torch(code),
                "target_met": None if is_control else med <= TARGET_S,
            }
        )
    control_seen = next(r["imports_torch"] for r in rows if r["target_met"] is None)  # the detector works
    ok = control_seen and all(r["target_met"] and not r["imports_torch"] for r in rows if r["target_met"] is not None)
    if a.json:
        print(json.dumps({"runs": a.n, "target_s": TARGET_S, "results": rows, "ok": ok}, indent=2))
    else:
        print(f"{'command':28} {'median s':>9} {'min s':>7} {'x import torch':>15} {'torch?':>7} target<={TARGET_S}s")
        for r in rows:
            met = "" if r["target_met"] is None else ("yes" if r["target_met"] else "NO")
            print(
                f"{r['command']:28} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['vs_import_torch']:15.3f} "
                f"{r['imports_torch']!s:>7} {met}"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

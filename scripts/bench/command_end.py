#!/usr/bin/env python3
"""A command's CPU as the console script ends it, beside the ordinary exit.

The console script (`hpcscale ...`, hpcscale.cli.entry.main) loads torch, where a command needs it, with the
cyclic collector paused (hpcscale.util.pystart.load_paused) and ends without the interpreter's teardown
(pystart.exit_now). The other case calls the same function with the arguments given (`main(ARGS)`: what an
embedding program does), which returns, then exits as Python does. Two commands: `ckpt export` of a small
checkpoint (it loads torch) and `config validate` of a job spec (it does not). Each case runs N times in fresh
processes, the cases alternating (the ratios hold on a noisy machine); CPU seconds of the process (user +
system, from wait4).

    python scripts/bench/command_end.py [-n 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# one rank's checkpoint of a small model: 53 tensors, as the tests' tiny GPT has
MAKE_CHECKPOINT = """
import sys
from pathlib import Path
import torch, torch.distributed as dist
from hpcscale.ckpt.manager import CheckpointManager
from hpcscale.layout import ParallelDims
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
g = torch.Generator().manual_seed(0)
tensors = {f"model/w{i}": torch.randn(32, 96, generator=g) for i in range(53)}
CheckpointManager(Path(sys.argv[1]), dims=ParallelDims(pp=1, dp=1, tp=1), rank=0, keep_last=2).save(
    1, tensors, {"step": 1}, asynchronous=False)
dist.destroy_process_group()
"""

ENDS = {
    "ordinary exit": "import sys; from hpcscale.cli.entry import main; main(sys.argv[1:])",
    "console script": "import sys; sys.argv[0] = 'hpcscale'; from hpcscale.cli.entry import main; main()",
}


def cpu_of(code: str, args: list[str]) -> float:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/"
    )
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) not in (0, 2):
        sys.exit(f"{args}: {proc.stderr.read().decode()[-2000:]}")
    proc.stderr.close()
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=9)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        subprocess.run([sys.executable, "-c", MAKE_CHECKPOINT, str(root)], check=True, cwd="/")
        commands = {
            "ckpt export": ["ckpt", "export", str(root), "-o", str(Path(tmp) / "model.safetensors")],
            "config validate": ["config", "validate", str(REPO / "docs" / "examples" / "gpt-dgx.yaml")],
        }
        samples = {(c, e): [] for c in commands for e in ENDS}
        for _ in range(a.n):  # alternating: drift hits every case alike
            for c, args in commands.items():
                for e, code in ENDS.items():
                    samples[(c, e)].append(cpu_of(code, args))
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [
        {
            "command": c,
            **{e: round(med[(c, e)], 3) for e in ENDS},
            "ratio": round(med[(c, "console script")] / med[(c, "ordinary exit")], 3),
        }
        for c in commands
    ]
    if a.json:
        print(json.dumps({"runs": a.n, "cpu_s_median": rows}, indent=2))
        return 0
    print(f"a command's CPU seconds, medians of {a.n} fresh processes per case, alternating")
    print(f"{'command':16s} {'ordinary exit':>14s} {'console script':>15s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['command']:16s} {r['ordinary exit']:14.3f} {r['console script']:15.3f} {r['ratio']:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

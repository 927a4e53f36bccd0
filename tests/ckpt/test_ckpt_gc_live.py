"""`hpcscale ckpt gc` beside a running job: it never removes a save in progress (a .tmp-* whose writer runs)
nor a pinned checkpoint (PINNED, which a job writes for a cross-site start checkpoint), and says so."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import REPO, run_cli

sys.path.insert(0, str(REPO / "tests" / "helpers"))
from ckpt_tamper import save_in_process


def _tensors(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model/rows": torch.randn(64, 8, generator=g), "model/cols": torch.randn(4, 32, generator=g)}


def test_gc_leaves_a_save_in_progress_and_a_pinned_checkpoint(tmp_path):
    from hpcscale.ckpt.retention import PINNED, WRITER, mark_writer, write_pins

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        save_in_process(root, step, _tensors(step))
    assert not (root / "step-00000004" / WRITER).exists()  # a committed save carries no writer mark
    write_pins(root, {1: "cross-site start checkpoint"})
    live = root / ".tmp-step-00000005"
    (live / "data").mkdir(parents=True)
    mark_writer(live)  # this process: alive
    dead = root / ".tmp-step-00000006"
    (dead / "data").mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    doc = json.loads((live / WRITER).read_text()) | {"pid": int(gone.stdout), "start": 1}
    (dead / WRITER).write_text(json.dumps(doc))  # a crashed save on this host: its process is gone

    result = run_cli("ckpt", "gc", str(root), "--keep", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kept"] == [4, 1] and report["removed"] == [3, 2]
    assert report["pinned"] == {"1": "cross-site start checkpoint"}
    assert [u.split(":")[0] for u in report["unfinished_left"]] == [".tmp-step-00000005"]
    assert live.is_dir() and not dead.exists()
    assert (root / "step-00000001" / "index.h5").is_file() and (root / PINNED).is_file()
    verify = run_cli("ckpt", "verify", str(root / "step-00000001"))
    assert verify.returncode == 0, verify.stdout + verify.stderr

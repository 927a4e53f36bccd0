#!/usr/bin/env python3
"""Staging benchmark: hpcscale stage against rsync on the same tree, side by side in one run.

Tree: N small files (1-16 KiB, spread over 100 directories) plus a few large ones; a few hundred MB in all.
  1. ssh on loopback (a real sshd, tests/helpers/sshd.py): first copy vs `rsync -a -e ssh`, then a rerun
     with nothing changed vs rsync's no-op rerun; the first copy again with --sync (durable before the
     destination manifest is written; rsync does not sync)
  2. local paths: first copy vs `rsync -a`; verified no-op rerun vs `rsync -ac` (hpcscale proves contents by
     its destination record plus size, mtime, ctime and inode; the --check hash rerun, which rehashes every
     destination file, is reported too)
  3. touch 1% of the files (new content), rebuild the manifest: how many files each tool moves
  4. manifest hashing (cold page cache) vs a raw read of the same files (cold)
Before every timed copy: `sync` and, as root, drop the page cache, so both tools read the source from disk
and neither pays for the other's dirty pages. Each pair runs `--reps` times in alternating order; medians.

    python scripts/bench/stage.py [--dir /var/tmp/hpcscale-bench-stage] [--small 10000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from sshd import LoopbackSshd  # noqa: E402


def drop_caches() -> bool:
    """Flush dirty pages, drop the page cache, then warm both tools' own program files again: the data is
    cold, the programs are not (a cold python stdlib would cost hpcscale far more than rsync's one binary)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        dropped = True
    except OSError:
        dropped = False
    for cmd in (
        ["rsync", "--version"],
        ["ssh", "-V"],
        hpcscale("stage", "--help"),
        hpcscale("manifest", "build", "--help"),
    ):
        subprocess.run(cmd, capture_output=True)
    return dropped


def compile_bytecode() -> str:
    """Compile hpcscale's modules to bytecode, as pip does when it installs the wheel. A checkout run with
    PYTHONDONTWRITEBYTECODE=1 (this sandbox sets it) would compile every module again at every start: ~35 ms of
    each hpcscale run that no installed copy pays."""
    import compileall

    import hpcscale

    root = Path(hpcscale.__file__).parent
    compileall.compile_dir(str(root), quiet=1)
    return str(root)


def make_tree(root: Path, small: int, large: int, large_mb: int) -> tuple[int, int]:
    rng = random.Random(7)
    total = 0
    for i in range(small):
        d = root / f"d{i % 100:03d}"
        d.mkdir(parents=True, exist_ok=True)
        n = rng.randint(1024, 16384)
        (d / f"f{i:06d}.bin").write_bytes(os.urandom(n))
        total += n
    for i in range(large):
        with open(root / f"large{i}.bin", "wb") as f:
            for _ in range(large_mb):
                f.write(os.urandom(1 << 20))
        total += large_mb << 20
    return small + large, total


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    dt = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({p.returncode}): {p.stderr[-2000:]}")
    return dt, p.stdout


def hpcscale(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcscale", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/hpcscale-bench-stage"))
    ap.add_argument("--small", type=int, default=10000)
    ap.add_argument("--large", type=int, default=4)
    ap.add_argument("--large-mb", type=int, default=50)
    ap.add_argument(
        "--jobs", type=int, default=2, help="hpcscale -j between local paths (processes; 2 and 4 alike on 2 cores)"
    )
    ap.add_argument(
        "--ssh-jobs", type=int, default=1, help="hpcscale -j over ssh (on 2 cores each extra stream costs CPU)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    compile_bytecode()
    base = a.dir
    shutil.rmtree(base, ignore_errors=True)
    src = base / "src"
    src.mkdir(parents=True)
    nfiles, nbytes = make_tree(src, a.small, a.large, a.large_mb)
    manifest = base / "manifest.json"
    timed(hpcscale("manifest", "build", str(src), "-o", str(manifest)))
    cold = drop_caches()
    sshd = LoopbackSshd(base / "sshd").start()
    ssh = sshd.ssh_string()
    stage_ssh = ["--ssh", ssh, "--remote-python", sys.executable, "-j", str(a.ssh_jobs)]
    results: dict[str, list[float]] = {}

    def clean(*paths: Path) -> None:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        drop_caches()

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    try:
        for rep in range(a.reps):
            order = ["rsync", "hpcscale"] if rep % 2 == 0 else ["hpcscale", "rsync"]
            # 1. ssh on loopback
            for tool in order:
                dst = base / f"ssh-{tool}"
                clean(dst)
                if tool == "rsync":
                    record("ssh_first_rsync", timed(["rsync", "-a", "-e", ssh, f"{src}/", f"127.0.0.1:{dst}/"])[0])
                    drop_caches()
                    record("ssh_noop_rsync", timed(["rsync", "-a", "-e", ssh, f"{src}/", f"127.0.0.1:{dst}/"])[0])
                else:
                    args = ["stage", str(manifest), "--from", str(src), "--to", sshd.url(dst), *stage_ssh]
                    record("ssh_first_hpcscale", timed(hpcscale(*args))[0])
                    drop_caches()
                    record("ssh_noop_hpcscale", timed(hpcscale(*args))[0])
                    clean(dst)
                    record("ssh_first_hpcscale_sync", timed(hpcscale(*args, "--sync"))[0])
            # 2. local paths
            for tool in order:
                dst = base / f"local-{tool}"
                clean(dst)
                if tool == "rsync":
                    record("local_first_rsync", timed(["rsync", "-a", f"{src}/", f"{dst}/"])[0])
                    drop_caches()
                    record("local_noop_rsync_c", timed(["rsync", "-ac", f"{src}/", f"{dst}/"])[0])
                else:
                    args = ["stage", str(manifest), "--from", str(src), "--to", str(dst), "-j", str(a.jobs)]
                    record("local_first_hpcscale", timed(hpcscale(*args))[0])
                    drop_caches()
                    record("local_noop_hpcscale", timed(hpcscale(*args))[0])
                    drop_caches()
                    record("local_noop_hpcscale_hash", timed(hpcscale(*args, "--check", "hash"))[0])

        # 3. touch 1% of the files: new content, then rebuild the manifest (reusing unchanged hashes)
        rng = random.Random(11)
        smalls = sorted(p for p in src.rglob("f*.bin"))
        touched = rng.sample(smalls, max(1, len(smalls) // 100))
        for p in touched:
            p.write_bytes(os.urandom(p.stat().st_size))
        t_rebuild, out = timed(hpcscale("manifest", "build", str(src), "-o", str(manifest), "--json"))
        rebuild = json.loads(out)
        args = ["stage", str(manifest), "--from", str(src), "--to", str(base / "local-hpcscale"), "--json"]
        h_local = json.loads(timed(hpcscale(*args))[1])
        args = ["stage", str(manifest), "--from", str(src), "--to", sshd.url(base / "ssh-hpcscale"), "--json"]
        h_ssh = json.loads(timed(hpcscale(*args, *stage_ssh))[1])
        _, rs = timed(["rsync", "-a", "--stats", f"{src}/", f"{base / 'local-rsync'}/"])
        rsync_moved = next(
            (
                int(line.split(":")[1].replace(",", ""))
                for line in rs.splitlines()
                if "regular files transferred" in line
            ),
            -1,
        )

        # 4. manifest hashing vs raw read, both cold
        for _ in range(a.reps):
            drop_caches()
            t = time.perf_counter()
            for p in sorted(src.rglob("*")):
                if p.is_file():
                    with open(p, "rb", buffering=0) as f:
                        while f.read(8 << 20):
                            pass
            record("read_raw", time.perf_counter() - t)
            drop_caches()
            record(
                "hash_build", timed(hpcscale("manifest", "build", str(src), "-o", str(base / "m2.json"), "--rehash"))[0]
            )
    finally:
        sshd.stop()

    med = {k: statistics.median(v) for k, v in results.items()}
    mbs = nbytes / 1e6
    doc = {
        "tree": {"files": nfiles, "bytes": nbytes, "small": a.small, "large": a.large, "large_mb": a.large_mb},
        "cold_cache": cold,
        "jobs": a.jobs,
        "ssh_jobs": a.ssh_jobs,
        "reps": a.reps,
        "seconds": {k: [round(x, 3) for x in v] for k, v in results.items()},
        "median_seconds": {k: round(v, 3) for k, v in med.items()},
        "ratios": {
            "ssh_first_throughput_vs_rsync": round(med["ssh_first_rsync"] / med["ssh_first_hpcscale"], 3),
            "ssh_first_sync_throughput_vs_rsync": round(med["ssh_first_rsync"] / med["ssh_first_hpcscale_sync"], 3),
            "ssh_noop_time_vs_rsync": round(med["ssh_noop_hpcscale"] / med["ssh_noop_rsync"], 3),
            "local_first_throughput_vs_rsync": round(med["local_first_rsync"] / med["local_first_hpcscale"], 3),
            "local_noop_time_vs_rsync_c": round(med["local_noop_hpcscale"] / med["local_noop_rsync_c"], 3),
            "local_noop_hash_time_vs_rsync_c": round(med["local_noop_hpcscale_hash"] / med["local_noop_rsync_c"], 3),
            "hash_throughput_vs_raw_read": round(med["read_raw"] / med["hash_build"], 3),
        },
        "touch_1pct": {
            "touched": len(touched),
            "manifest_rebuild": {
                "seconds": round(t_rebuild, 3),
                "hashed": rebuild["hashed"],
                "reused": rebuild["reused"],
            },
            "hpcscale_local_sent": h_local["sent"],
            "hpcscale_ssh_sent": h_ssh["sent"],
            "rsync_local_transferred": rsync_moved,
        },
        "targets": {
            "ssh_first_throughput_vs_rsync": ">= 1.0",
            "ssh_noop_time_vs_rsync": "<= 1.0",
            "local_first_throughput_vs_rsync": ">= 0.9",
            "local_noop_time_vs_rsync_c": "<= 1.0",
        },
    }
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"tree: {nfiles} files, {mbs:.0f} MB; -j {a.jobs} local, {a.ssh_jobs} ssh; {a.reps} reps; cold cache: {cold}")
    print(f"{'measure':37} {'hpcscale s':>11} {'rsync s':>9} {'ratio':>7}  target")
    rows = [
        ("ssh first copy (throughput)", "ssh_first_hpcscale", "ssh_first_rsync", "ssh_first_throughput_vs_rsync"),
        (
            "ssh first copy, --sync (throughput)",
            "ssh_first_hpcscale_sync",
            "ssh_first_rsync",
            "ssh_first_sync_throughput_vs_rsync",
        ),
        ("ssh no-op rerun (time)", "ssh_noop_hpcscale", "ssh_noop_rsync", "ssh_noop_time_vs_rsync"),
        (
            "local first copy (throughput)",
            "local_first_hpcscale",
            "local_first_rsync",
            "local_first_throughput_vs_rsync",
        ),
        (
            "local no-op, proven (time) vs -ac",
            "local_noop_hpcscale",
            "local_noop_rsync_c",
            "local_noop_time_vs_rsync_c",
        ),
        (
            "local no-op, rehash (time) vs -ac",
            "local_noop_hpcscale_hash",
            "local_noop_rsync_c",
            "local_noop_hash_time_vs_rsync_c",
        ),
        ("hashing vs raw read (throughput)", "hash_build", "read_raw", "hash_throughput_vs_raw_read"),
    ]
    for label, h, r, ratio in rows:
        print(f"{label:37} {med[h]:11.3f} {med[r]:9.3f} {doc['ratios'][ratio]:7.3f}  {doc['targets'].get(ratio, '')}")
    t = doc["touch_1pct"]
    print(
        f"touched {t['touched']} files: manifest rebuild hashed {t['manifest_rebuild']['hashed']} "
        f"(reused {t['manifest_rebuild']['reused']}) in {t['manifest_rebuild']['seconds']} s; "
        f"hpcscale sent {t['hpcscale_local_sent']} (local), {t['hpcscale_ssh_sent']} (ssh); "
        f"rsync sent {t['rsync_local_transferred']}"
    )
    print(f"hashing: {mbs / med['hash_build']:.0f} MB/s, raw read {mbs / med['read_raw']:.0f} MB/s")


if __name__ == "__main__":
    main()

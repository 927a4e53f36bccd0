"""Safe file I/O on hpcscale's own primitives, for real (tmpfs, a second user, FIFOs, a kill mid-write):
whole-file writes whole or not at all (keys, a prepared dataset's files), one JSON-lines appender for every
log, a YAML file read once from the descriptor checked, and bounded reads of files others may write."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import need
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcscale.errors import BadInput
from hpcscale.portable import files

REPO = Path(__file__).resolve().parents[2]


# ---- helpers -------------------------------------------------------------------------------------------------
def _killed_mid_write(code: str, limit: int) -> subprocess.CompletedProcess:
    """Run `code` (after its imports) in a fresh Python whose files may hold at most `limit` bytes: the write
    that crosses it is cut short and the next one is killed by SIGXFSZ, as a kill -9 mid-write would."""
    setup = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default kills
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        """
    )
    imports, _, body = code.partition("# --\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", imports + setup + body], capture_output=True, text=True, env=env, timeout=60
    )


def _finishes(fn, *fifos: Path, within: float = 10.0):
    """fn()'s result or exception, asserting it returns within `within` seconds; a call still waiting (on a FIFO
    at one of `fifos`) is released by opening and closing their write end, and the test fails."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(within)
    if t.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail(f"still waiting after {within} s (blocked on a FIFO)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs with 4 KiB left (a `filler` file holds the rest; remove it to free the space)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(disk)], capture_output=True
    )
    need(mounted.returncode == 0, f"mounting a tmpfs (root): {mounted.stderr.decode().strip()}")
    try:
        (disk / "filler").write_bytes(b"\0" * (60 * 1024))
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _lines(path: Path) -> list:
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(None)  # a torn line
    return out


# ---- (1) whole files, whole or not at all ----------------------------------------------------------------------
def test_a_key_killed_mid_write_leaves_no_part_of_it_under_its_name(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    r = _killed_mid_write(
        f"from hpcscale.xsite.signing import generate_key\n# --\ngenerate_key({str(keys)!r}, 'alpha')\n", limit=60
    )
    assert r.returncode == -signal.SIGXFSZ, r.stderr
    assert not os.path.lexists(keys / "alpha.key")  # the PEM is ~119 bytes: only part of it was written
    assert not os.path.lexists(keys / "alpha.pub")
    for leftover in keys.iterdir():  # a temporary the kill left: never readable by others
        assert leftover.name.startswith(".alpha.key.") and leftover.stat().st_mode & 0o777 == 0o600


def test_a_key_is_created_whole_with_mode_0600_and_never_overwritten(tmp_path):
    from hpcscale.xsite.signing import generate_key, load_private

    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    os.umask(old := os.umask(0o000))
    try:
        made = generate_key(keys, "alpha")
    finally:
        os.umask(old)
    assert made.private.stat().st_mode & 0o777 == 0o600 and made.public.stat().st_mode & 0o777 == 0o644
    load_private(made.private)
    before = made.private.read_bytes()
    made.public.unlink()
    with pytest.raises(BadInput, match="already exists"):
        generate_key(keys, "alpha")
    assert made.private.read_bytes() == before and sorted(p.name for p in keys.iterdir()) == ["alpha.key"]


def test_prepare_killed_mid_write_leaves_no_part_of_a_file_under_its_name(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"word{i}": i for i in range(40)} | {"[UNK]": 40}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(f"word{i % 40}" for i in range(2000)))
    size = (tmp_path / "tok.json").stat().st_size
    r = _killed_mid_write(
        "from pathlib import Path\nfrom hpcscale.data.prepare import prepare\n# --\n"
        f"prepare(Path({str(corpus)!r}), Path({str(tmp_path / 'out')!r}), sample_len=9, shard_samples=4,"
        f" tokenizer=Path({str(tmp_path / 'tok.json')!r}))\n",
        limit=size // 2,
    )
    assert r.returncode == -signal.SIGXFSZ, r.stderr
    assert not os.path.lexists(tmp_path / "out")
    partial = [p for p in tmp_path.rglob("tokenizer.json")]
    assert partial == [], f"part of the tokenizer under its name: {partial}"


# ---- (2) one JSON-lines appender -------------------------------------------------------------------------------
def test_the_appender_refuses_a_symlink_a_fifo_and_a_long_line_and_writes_nothing(tmp_path, other_user):
    shared = tmp_path / "shared"
    other_user.make(shared, directory=True, mode=0o777)
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    os.symlink(victim, shared / "log.jsonl")  # planted by the other user (pytest's tmp_path is root's, 0700)
    os.lchown(shared / "log.jsonl", other_user.uid, other_user.gid)
    with pytest.raises(OSError) as e:
        files.append_json_lines(shared / "log.jsonl", [{"a": 1}])
    assert e.value.errno == errno.ELOOP and victim.read_text() == "mine\n"

    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(files.NotRegularFile):
        _finishes(lambda: files.append_json_lines(tmp_path / "fifo.jsonl", [{"a": 1}]), tmp_path / "fifo.jsonl")

    log = tmp_path / "log.jsonl"
    with pytest.raises(files.TooLarge):
        files.append_json_lines(log, [{"a": 1}, {"b": "x" * 100}], max_line=64)
    assert not log.exists()  # the first line either: every line is checked before the file is opened


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.dictionaries(st.text(max_size=8), st.text(max_size=40) | st.integers(), max_size=4), max_size=5))
def test_appended_lines_read_back_as_written(tmp_path, docs):
    log = tmp_path / f"log-{os.urandom(4).hex()}.jsonl"
    size = files.append_json_lines(log, docs, sort_keys=True)
    data = log.read_bytes() if docs else b""
    assert size == len(data) and data.count(b"\n") == len(docs)
    assert [json.loads(line) for line in data.splitlines()] == docs


def _fill_then_append(disk: Path, append) -> Path:
    """Append a 6 KiB line to a disk with 4 KiB left (a full disk mid-line), free the disk, append a short one:
    the short line must read back whole."""
    with pytest.raises((OSError, BadInput)):
        append([{"big": "x" * 6000}])
    (disk / "filler").unlink()
    append([{"after": "the disk was freed"}])
    return disk


def test_a_full_disk_mid_line_never_swallows_the_next_line(full_disk):
    log = full_disk / "log.jsonl"
    _fill_then_append(full_disk, lambda docs: files.append_json_lines(log, docs))
    assert _lines(log)[-1] == {"after": "the disk was freed"}


def test_the_run_logs_use_the_appender(full_disk):
    from hpcscale.rundir import append_json_line

    log = full_disk / "attempts.jsonl"
    _fill_then_append(full_disk, lambda docs: append_json_line(log, docs[0]))
    assert _lines(log)[-1] == {"after": "the disk was freed"}


def test_the_sync_log_uses_the_appender(full_disk):
    from hpcscale.xsite.rounds import LOG, _append_log

    def append(docs):
        _append_log(full_disk, docs)
        if "big" in docs[0]:  # the tick reports the OSError; the test wants it raised or the line whole
            raise OSError(errno.ENOSPC, "expected a full disk")

    _fill_then_append(full_disk, append)
    assert _lines(full_disk / LOG)[-1] == {"after": "the disk was freed"}


def test_the_timing_log_uses_the_appender(full_disk, capfd):
    from hpcscale.launch.timing import StepTimes

    times = StepTimes(run_dir=full_disk, every=1, rank=0, node="n0", pp=0, attempt=0)

    def append(docs):
        times._append(docs[0])
        if "big" in docs[0]:
            raise OSError(errno.ENOSPC, "expected a full disk")

    _fill_then_append(full_disk, append)
    assert _lines(times.path)[-1] == {"after": "the disk was freed"}
    assert "cannot record per-rank timing" in capfd.readouterr().err


# ---- (3) read, then check the descriptor read ------------------------------------------------------------------
_SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
a, b, end = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    libc.renameat2(-100, a, -100, b, 2)  # RENAME_EXCHANGE: the name is a regular file, then a FIFO, ...
"""

_LOADER = """
import sys, time
from hpcscale.config.errors import ConfigError
from hpcscale.config.yamlsrc import load_yaml
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        load_yaml(sys.argv[1])
    except ConfigError:
        pass
print("done")
"""


def test_a_yaml_file_swapped_for_a_fifo_is_never_waited_on(tmp_path):
    job, fifo = tmp_path / "job.yaml", tmp_path / "swap"
    job.write_text("name: x\n")
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(job), str(fifo), "8"])
    try:
        time.sleep(0.3)
        r = subprocess.run(
            [sys.executable, "-c", _LOADER, str(job), "3"], capture_output=True, text=True, env=env, timeout=20
        )
    except subprocess.TimeoutExpired:
        pytest.fail("load_yaml waited on a FIFO swapped in after its check")
    finally:
        swapper.kill()
        swapper.wait()
    assert r.returncode == 0 and "done" in r.stdout, r.stderr


def test_a_yaml_fifo_or_directory_is_refused(tmp_path):
    from hpcscale.config.errors import ConfigError
    from hpcscale.config.yamlsrc import load_yaml

    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(ConfigError, match="not a regular file"):
        _finishes(lambda: load_yaml(tmp_path / "fifo.yaml"), tmp_path / "fifo.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_yaml(tmp_path)


# ---- (4) bounded reads of files others can write ---------------------------------------------------------------
def test_lineage_reads_neither_a_fifo_job_spec_nor_a_fifo_manifest(tmp_path):
    from types import SimpleNamespace

    from hpcscale.ckpt import lineage

    os.mkfifo(tmp_path / "job.yaml")
    os.mkfifo(tmp_path / "manifest.json")
    job = SimpleNamespace(data=SimpleNamespace(manifest=str(tmp_path / "manifest.json")), train=None)
    out = _finishes(lambda: lineage.collect(tmp_path, job), tmp_path / "job.yaml", tmp_path / "manifest.json")
    assert "not a regular file" in out["job"]["error"] and str(tmp_path / "job.yaml") in out["job"]["error"]
    assert "not a regular file" in out["data_manifest"]["error"]


def test_lineage_reads_at_most_a_job_specs_bound(tmp_path):
    from types import SimpleNamespace

    from hpcscale.ckpt import lineage

    with open(tmp_path / "job.yaml", "wb") as f:
        f.truncate(lineage.MAX_JOB_BYTES + 1)
    out = lineage.collect(tmp_path, SimpleNamespace(data=None, train=None))
    assert "over the limit" in out["job"]["error"]


def test_smoke_skips_a_fifo_rank_report_and_reads_only_the_metrics_tail(tmp_path):
    from hpcscale.smoke import checks
    from hpcscale.smoke.probe import SMOKE_DIR

    (tmp_path / SMOKE_DIR).mkdir()
    os.mkfifo(tmp_path / SMOKE_DIR / "rank-00000.json")
    (tmp_path / SMOKE_DIR / "rank-00001.json").write_text('{"rank": 1}')
    assert _finishes(lambda: checks._rank_reports(tmp_path), tmp_path / SMOKE_DIR / "rank-00000.json") == [{"rank": 1}]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"step": 1, "loss": 1.0}\n' + "#" * (checks.METRICS_TAIL + 10) + '\n{"step": 2, "loss": 2.0}\n')
    assert checks._metric(tmp_path, "loss") == {2: 2.0}


def test_a_shard_of_the_wrong_size_or_a_fifo_is_refused_naming_it(tmp_path):
    from hpcscale.data.loader import TokenLoader
    from hpcscale.data.prepare import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(bytes(range(256)) * 8)
    out = tmp_path / "ds"
    m = prepare(corpus, out, sample_len=9, shard_samples=64)
    shard = out / m.dataset.shards[0].path
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    kw = dict(seq_len=8, global_batch=2, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(BadInput, match=f"{shard}: .* bytes, but the manifest gives"):
        TokenLoader(out / "manifest.json", **kw)
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(BadInput, match=f"{shard}: not a regular file"):
        _finishes(lambda: TokenLoader(out / "manifest.json", **kw), shard)


def test_hashing_a_dataset_file_never_waits_on_a_fifo(tmp_path):
    from hpcscale.data.manifest import hash_file

    os.mkfifo(tmp_path / "f")
    with pytest.raises(files.NotRegularFile):
        _finishes(lambda: hash_file(tmp_path / "f", "sha256"), tmp_path / "f")


def test_a_fifo_checkpoint_index_is_refused_not_waited_on(tmp_path):
    step = tmp_path / "step-00000005"
    step.mkdir()
    os.mkfifo(step / "index.h5")
    code = (
        "import sys\nfrom pathlib import Path\nfrom hpcscale.ckpt.format import examine_index\n"
        "print(examine_index(Path(sys.argv[1])).problems[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:  # HDF5 waits in open(2) holding the GIL: only a separate process can be given up on
        r = subprocess.run([sys.executable, "-c", code, str(step / "index.h5")], capture_output=True, text=True,
                           env=env, timeout=30)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("examine_index waited on a FIFO at index.h5")
    assert r.returncode == 0 and "not a regular file" in r.stdout, r.stderr

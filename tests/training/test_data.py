"""Data: prepare, the manifest's safety rules, the deterministic loader and its exact position."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcscale.data.loader import TokenLoader
from hpcscale.data.manifest import check_relpath, read_manifest
from hpcscale.data.prepare import document_order, prepare
from hpcscale.errors import BadInput


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for i in range(5):
        (src / f"f{i}.txt").write_text("".join(f"line {j} of file {i}: hpcscale\n" for j in range(300)))
    out = tmp_path_factory.mktemp("ds") / "ds"
    prepare(src, out, sample_len=33, shard_samples=100)
    return out / "manifest.json"


def test_prepare_writes_shards_and_a_verified_manifest(dataset):
    m = read_manifest(dataset)
    assert m.dataset is not None and m.dataset.sample_len == 33 and len(m.dataset.shards) > 1
    for f in m.files:
        assert (dataset.parent / f.path).stat().st_size == f.size
    import xxhash

    first = m.files[0]
    assert xxhash.xxh3_128((dataset.parent / first.path).read_bytes()).hexdigest() == first.hash
    assert m.hash_algorithm == "xxh128"


def test_prepare_is_deterministic_and_never_overwrites(dataset, tmp_path):
    src = Path(json.loads(dataset.read_text())["meta"]["source"])
    again = prepare(src, tmp_path / "again", sample_len=33, shard_samples=100)
    assert [f.hash for f in again.files] == [f.hash for f in read_manifest(dataset).files]
    with pytest.raises(BadInput, match="exists"):
        prepare(src, tmp_path / "again", sample_len=33)


def _loader(manifest: Path, dp_rank: int, dp_size: int, **kw) -> TokenLoader:
    return TokenLoader(manifest, seq_len=32, global_batch=8, dp_rank=dp_rank, dp_size=dp_size, seed=3, **kw)


def test_dp_ranks_split_the_same_global_batch(dataset):
    whole = _loader(dataset, 0, 1)
    parts = [_loader(dataset, r, 4) for r in range(4)]
    for _ in range(5):
        x, y = whole.next_batch()
        xs = [p.next_batch()[0] for p in parts]
        assert np.array_equal(np.concatenate(xs), x)
        assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_order_is_fixed_by_seed_and_epoch(dataset):
    a, b = _loader(dataset, 0, 1), _loader(dataset, 0, 1)
    assert all(np.array_equal(a.next_batch()[0], b.next_batch()[0]) for _ in range(3))
    c = TokenLoader(dataset, seq_len=32, global_batch=8, dp_rank=0, dp_size=1, seed=4)
    assert not np.array_equal(_loader(dataset, 0, 1).next_batch()[0], c.next_batch()[0])


def test_position_restores_exactly_across_epochs(dataset):
    a = _loader(dataset, 1, 2)
    for _ in range(a.batches_per_epoch + 2):  # into the second epoch
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch()[0] for _ in range(3)]
    b = _loader(dataset, 1, 2)
    b.load_state_dict(state)
    assert state["epoch"] == 1
    assert all(np.array_equal(e, b.next_batch()[0]) for e in expected)


def test_validation_samples_are_held_out(dataset):
    a = _loader(dataset, 0, 1, val_fraction=0.2)
    val = {bytes(row) for x, _ in a.val_batches(10) for row in x.astype(np.uint8)}
    train = {bytes(row) for _ in range(a.batches_per_epoch) for row in a.next_batch()[0].astype(np.uint8)}
    assert val and not (val & train)


def _held_out_documents(tmp: Path, seed: int, fraction: float) -> tuple[set[str], set[str]]:
    """(documents seen only in validation, documents seen in training) of a corpus of 40 files, each written
    in a letter of its own, prepared with `seed`."""
    src = tmp / "src"
    if not src.exists():
        src.mkdir()
        for i in range(40):
            (src / f"doc{i:02d}.txt").write_text(chr(ord("A") + i) * (200 + 37 * i))
    ds = tmp / f"ds-{seed}"
    prepare(src, ds, sample_len=33, shard_samples=64, seed=seed)
    loader = TokenLoader(ds / "manifest.json", seq_len=32, global_batch=4, dp_rank=0, dp_size=1, seed=1,
                         val_fraction=fraction)  # fmt: skip

    def letters(rows):
        return {chr(b) for x in rows for b in x.reshape(-1).astype(np.uint8).tolist()} - {"\n"}

    val = letters(x for x, _ in loader.val_batches(10_000))
    train = letters(loader.next_batch()[0] for _ in range(loader.batches_per_epoch))
    return val - train, train


def test_validation_holds_out_a_seeded_sample_of_whole_documents(tmp_path):
    """The held-out samples are whole documents (only the one the split cuts is on both sides), the last ones
    of the seeded document order, not the corpus's last files by name; another seed holds out others."""
    only_val, train = _held_out_documents(tmp_path, 0, 0.25)
    names = [chr(ord("A") + i) for i in range(40)]
    order = [names[i] for i in document_order(40, 0)]
    assert len(only_val) >= 5 and only_val <= set(order[-len(only_val) - 1 :])  # whole documents, drawn by seed
    assert len(set(names) - train - only_val) <= 1  # every document is somewhere (the cut one may be both)
    assert only_val != set(names[-len(only_val) :])  # not a corner of the corpus
    assert _held_out_documents(tmp_path, 1, 0.25)[0] != only_val


def test_seq_len_longer_than_samples_is_bad_input(dataset):
    with pytest.raises(BadInput, match="samples hold 33 tokens"):
        TokenLoader(dataset, seq_len=40, global_batch=8, dp_rank=0, dp_size=1, seed=0)


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "", "./a", "a//b", "a\\b"])
def test_unsafe_manifest_paths_are_rejected(path):
    assert check_relpath(path) is not None


def test_manifest_with_escaping_path_is_bad_input(dataset, tmp_path):
    doc = json.loads(dataset.read_text())
    doc["files"][0]["path"] = "../../etc/passwd"
    bad = tmp_path / "manifest.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(BadInput, match=r"files\[0\]: path '../../etc/passwd' contains '..'"):
        read_manifest(bad)
    doc["files"][0]["path"] = "shards/000000.bin"
    doc["hash_algorithm"] = "md5"
    bad.write_text(json.dumps(doc))
    with pytest.raises(BadInput, match="hash_algorithm: unknown 'md5'"):
        read_manifest(bad)


def test_data_prepare_cli(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello hpcscale " * 2000)
    result = run_cli(
        "data", "prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "ds"), "--seq-len", "63", "--json"
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["sample_len"] == 64 and doc["samples"] == 30000 // 64
    assert doc["documents"] == 1 and doc["document_order"] == "shuffled, seed 0"
    again = run_cli("data", "prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "ds"))
    assert again.returncode == 2 and "exists" in again.stderr


def _word_tokenizer(path: Path, words: list[str]) -> None:
    """A small tokenizers file: a word-level vocabulary with an unknown token, saved as JSON."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(set(words)))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


WORDS = st.lists(st.sampled_from(["alpha", "beta", "gamma", "delta", "eps", "x", "hpcscale", "!"]), max_size=60)


@settings(max_examples=25, deadline=None)
@given(docs=st.lists(WORDS, min_size=1, max_size=5), sample_len=st.integers(2, 9), shard_samples=st.integers(1, 7))
def test_prepare_with_a_tokenizer_stores_each_files_ids_in_order_with_the_tokenizer_hashed(
    tmp_path_factory, docs, sample_len, shard_samples
):
    """Shards hold the ids of every file's text, file after file in the seeded document order, cut into whole
    samples; the tokenizer file travels in the dataset, listed and hashed; the manifest reads back as written."""
    from tokenizers import Tokenizer

    from hpcscale.data.manifest import hasher

    tmp = tmp_path_factory.mktemp("tok")
    src = tmp / "src"
    src.mkdir()
    for i, words in enumerate(docs):
        (src / f"f{i}.txt").write_text(" ".join(words))
    _word_tokenizer(tmp / "tok.json", ["alpha", "beta", "gamma", "delta", "eps", "x", "hpcscale"])  # no "!"
    tok = Tokenizer.from_file(str(tmp / "tok.json"))
    order = document_order(len(docs), 0)  # f0..f4 sort by name as they are numbered
    ids = [i for k in order for i in tok.encode(" ".join(docs[k]), add_special_tokens=False).ids]
    n = len(ids) // sample_len
    if n == 0:
        with pytest.raises(BadInput, match="fewer than one sample"):
            prepare(src, tmp / "ds", sample_len=sample_len, tokenizer=tmp / "tok.json")
        assert not (tmp / "ds").exists()
        return
    m = prepare(src, tmp / "ds", sample_len=sample_len, shard_samples=shard_samples, tokenizer=tmp / "tok.json")
    again = read_manifest(tmp / "ds" / "manifest.json")
    assert again.dataset == m.dataset and m.dataset.dtype == "uint16" and m.dataset.vocab_size == 8
    stored = np.concatenate([np.fromfile(tmp / "ds" / s.path, dtype=np.uint16) for s in m.dataset.shards])
    assert stored.tolist() == ids[: n * sample_len]
    listed = {f.path: f.hash for f in m.files}
    h = hasher(m.hash_algorithm)
    h.update((tmp / "tok.json").read_bytes())
    assert listed["tokenizer.json"] == h.hexdigest() == m.meta["tokenizer_hash"]
    assert (tmp / "ds" / "tokenizer.json").read_bytes() == (tmp / "tok.json").read_bytes()


# -- where the dataset is built: nothing planted by another user is written through or replaced ------------


@pytest.fixture
def area(other_user) -> Path:
    """A directory both users can reach (pytest's own tmp is root's alone, 0700), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="hpcscale-test-data-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base)


def _shared_dir(other_user, tmp_path: Path) -> Path:
    """A project directory the other user (same group) can write to, as shared project areas are."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, os.getuid(), other_user.gid)
    os.chmod(shared, 0o2775)
    return shared


def test_prepare_builds_in_a_private_directory_and_never_writes_through_a_planted_link(other_user, area):
    """The other user plants a symbolic link at every build name they could guess (the old `.NAME.tmp.PID`)
    pointing into a directory of theirs: the dataset is built elsewhere, appears at --out as a real directory
    of ours, and nothing lands in theirs."""
    shared = _shared_dir(other_user, area)
    theirs = other_user.make(area / "theirs", directory=True)
    (area / "corpus.txt").write_text("hello hpcscale\n" * 400)
    for name in (f".ds.tmp.{os.getpid()}", ".ds.tmp", ".ds"):
        r = other_user.run("ln", "-s", str(theirs), str(shared / name))
        assert r.returncode == 0, r.stderr
    m = prepare(area / "corpus.txt", shared / "ds", sample_len=33, shard_samples=50)
    out = shared / "ds"
    assert out.is_dir() and not out.is_symlink() and out.lstat().st_uid == os.getuid()
    assert list(theirs.iterdir()) == []
    assert {f.path for f in m.files} <= {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_umask()  # mkdir's mode, not the build's 0700
    leftovers = sorted(p.name for p in shared.iterdir())
    assert leftovers == sorted([f".ds.tmp.{os.getpid()}", ".ds.tmp", ".ds", "ds"])  # theirs left as they were


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("planted", ["dangling link", "link to their dir", "empty dir", "file"])
def test_prepare_refuses_whatever_the_other_user_planted_at_the_final_name(other_user, area, planted):
    """A name that exists at --out, whoever made it and whatever it is, is refused with exit 2 and left as it
    is; no build directory is left behind."""
    shared = _shared_dir(other_user, area)
    theirs = other_user.make(area / "theirs", directory=True)
    (area / "corpus.txt").write_text("hello hpcscale\n" * 400)
    out = shared / "ds"
    if planted == "dangling link":
        assert other_user.run("ln", "-s", str(theirs / "later"), str(out)).returncode == 0
    elif planted == "link to their dir":
        assert other_user.run("ln", "-s", str(theirs), str(out)).returncode == 0
    elif planted == "empty dir":
        other_user.make(out, directory=True)
    else:
        other_user.make(out, text="theirs")
    before = os.lstat(out)
    r = run_cli("data", "prepare", str(area / "corpus.txt"), "--out", str(out), "--seq-len", "32")
    assert r.returncode == 2, r.stderr
    assert str(out) in r.stderr and "exists" in r.stderr and "Traceback" not in r.stderr
    after = os.lstat(out)
    assert (after.st_ino, after.st_uid, after.st_mode) == (before.st_ino, before.st_uid, before.st_mode)
    assert list(theirs.iterdir()) == []
    assert [p.name for p in shared.iterdir()] == ["ds"]


def test_what_appears_at_the_final_name_during_the_build_is_never_replaced(other_user, area):
    """The other user plants a symbolic link, then an empty directory, at --out while the dataset is being built:
    the rename into place refuses (RENAME_NOREPLACE), exit 2 naming --out; theirs stays as it was, the build
    directory is gone."""
    from hpcscale.data.builddir import BuildDir

    shared = _shared_dir(other_user, area)
    theirs = other_user.make(area / "theirs", directory=True)
    out = shared / "ds"
    for plant in (["ln", "-s", str(theirs), str(out)], ["mkdir", str(out)]):
        appeared = r"ds: something appeared at this name while the dataset was prepared"
        with pytest.raises(BadInput, match=appeared), BuildDir(out) as build:
            os.close(BuildDir.create("data.bin", dir_fd=build.fd))
            assert other_user.run(*plant).returncode == 0
            build.commit()
        assert out.lstat().st_uid == other_user.uid and list(theirs.iterdir()) == []
        assert [p.name for p in shared.iterdir()] == ["ds"]
        (out.unlink() if out.is_symlink() else out.rmdir())


def test_a_build_directory_swapped_for_another_is_never_renamed_into_place(other_user, area):
    """The other user (write access to the parent) renames the build directory away and puts one of theirs under
    its name: the commit refuses it, and every file written went into ours, never theirs."""
    from hpcscale.data.builddir import BuildDir

    shared = _shared_dir(other_user, area)
    out = shared / "ds"
    with pytest.raises(BadInput, match="was replaced by someone else"), BuildDir(out) as build:
        r = other_user.run("mv", str(shared / build.name), str(shared / "stolen"))
        assert r.returncode == 0, r.stderr
        assert other_user.run("mkdir", str(shared / build.name)).returncode == 0
        os.close(BuildDir.create("data.bin", dir_fd=build.fd))
        build.commit()
    assert not out.exists() and (shared / "stolen" / "data.bin").exists()
    assert list((shared / build.name).iterdir()) == []  # theirs: nothing written into it, left in place


def test_a_failed_prepare_leaves_nothing_behind(tmp_path):
    (tmp_path / "corpus.txt").write_text("tiny")
    (tmp_path / "out").mkdir()
    with pytest.raises(BadInput, match="fewer than one sample"):
        prepare(tmp_path / "corpus.txt", tmp_path / "out" / "ds", sample_len=33)
    assert list((tmp_path / "out").iterdir()) == []


def test_the_default_dataset_is_used_only_when_it_is_ours(other_user, area):
    """In a shared scratch directory, a default dataset (or its parent) planted by another user is refused with
    exit 2 naming it, never trained on; one of ours is prepared once and reused."""
    from hpcscale.data.prepare import default_corpus_dataset

    shared = _shared_dir(other_user, area)
    other_user.make(shared / "hpcscale-data", directory=True)
    with pytest.raises(BadInput, match=r"hpcscale-data: refusing the default dataset: owned by hpcscale-other"):
        default_corpus_dataset(shared, sample_len=33)
    os.rmdir(shared / "hpcscale-data")
    assert other_user.run("ln", "-s", str(area), str(shared / "hpcscale-data")).returncode == 0
    with pytest.raises(BadInput, match="a symbolic link"):
        default_corpus_dataset(shared, sample_len=33)


# -- a tokenizer's vocabulary: the largest id + 1, and the shards' dtype holds it ------------------------------


def _sparse_tokenizer(path: Path, vocab: dict[str, int], added: list[str] = ()) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if added:
        tok.add_tokens(list(added))
    tok.save(str(path))


@pytest.mark.parametrize(
    "vocab, added, want_vocab, want_dtype",
    [
        ({"[UNK]": 0, "a": 5, "b": 300}, [], 301, "uint16"),
        ({"[UNK]": 0, "a": 5, "b": 70000}, [], 70001, "uint32"),
        ({"[UNK]": 0, "a": 5, "b": 70000}, ["zz"], 70001, "uint32"),  # an added token takes a free id (3)
        ({"[UNK]": 0, "a": 1, "b": 2}, ["zz"], 4, "uint16"),  # ...or the next one past the vocabulary
    ],
)
def test_a_tokenizer_with_gaps_in_its_ids_gets_its_largest_id_plus_one(tmp_path, vocab, added, want_vocab, want_dtype):
    """vocab_size is the largest id + 1 over the whole vocabulary (added tokens too), not the number of
    entries; ids over 65535 are stored as uint32; the loader reads back exactly the ids written."""
    from tokenizers import Tokenizer

    _sparse_tokenizer(tmp_path / "tok.json", vocab, added)
    text = " ".join(["a", "b", "zz", "a", "q"] * 200)
    (tmp_path / "corpus.txt").write_text(text)
    r = run_cli(
        "data", "prepare", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tok.json"),
        "--out", str(tmp_path / "ds"), "--seq-len", "15", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["vocab_size"], doc["dtype"]) == (want_vocab, want_dtype)
    m = read_manifest(tmp_path / "ds" / "manifest.json")
    assert (m.dataset.vocab_size, m.dataset.dtype) == (want_vocab, want_dtype)
    ids = Tokenizer.from_file(str(tmp_path / "tok.json")).encode(text, add_special_tokens=False).ids
    stored = np.concatenate([np.fromfile(tmp_path / "ds" / s.path, dtype=want_dtype) for s in m.dataset.shards])
    assert stored.tolist() == ids[: len(stored)] and max(ids) < want_vocab
    loader = TokenLoader(tmp_path / "ds" / "manifest.json", seq_len=15, global_batch=4, dp_rank=0, dp_size=1, seed=0)
    x, _ = loader.next_batch()
    assert x.dtype == np.int64 and set(x.reshape(-1).tolist()) <= set(ids)


def test_a_dataset_whose_manifest_understates_its_vocabulary_is_refused_before_a_batch_reaches_a_model(tmp_path):
    """A dataset prepared before vocab_size was the largest id + 1 (its manifest says 3 for ids up to 300):
    the loader refuses the batch, naming the manifest, the id and vocab_size; a manifest without `dtype` (from
    before it was written) reads its shards as uint16."""
    _sparse_tokenizer(tmp_path / "tok.json", {"[UNK]": 0, "a": 5, "b": 300})
    (tmp_path / "corpus.txt").write_text("a b " * 400)
    prepare(tmp_path / "corpus.txt", tmp_path / "ds", sample_len=16, tokenizer=tmp_path / "tok.json")
    path = tmp_path / "ds" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["dataset"]["vocab_size"] = 3
    del doc["dataset"]["dtype"]
    path.write_text(json.dumps(doc))
    assert read_manifest(path).dataset.dtype == "uint16"
    loader = TokenLoader(path, seq_len=15, global_batch=4, dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(
        BadInput, match=r"manifest.json: sample \d+ holds token id (300|5), but the dataset's vocab_size is 3"
    ):
        loader.next_batch()


def test_the_trainer_refuses_a_dataset_with_ids_past_its_vocabulary_before_the_first_step(mpi, tmp_path):
    """The built-in trainer sizes its model to the manifest's vocab_size; ids past it (an old dataset of a
    tokenizer with gaps in its ids) end the job with exit 2 naming the manifest, before any step (was: an
    IndexError inside the embedding; on a GPU, a device-side assert)."""
    from trainjobs import job_spec

    _sparse_tokenizer(tmp_path / "tok.json", {"[UNK]": 0, "a": 5, "b": 300})
    (tmp_path / "corpus.txt").write_text("a b " * 2000)
    prepare(tmp_path / "corpus.txt", tmp_path / "ds", sample_len=33, tokenizer=tmp_path / "tok.json")
    path = tmp_path / "ds" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["dataset"]["vocab_size"] = 6  # 300 is past it
    path.write_text(json.dumps(doc))
    job = job_spec(tmp_path / "job.yaml", tp=1, pp=1, ranks=1, steps=2)
    spec = yaml.safe_load(job.read_text())
    spec["data"] = {"manifest": str(path)}
    job.write_text(yaml.safe_dump(spec))
    r = run_cli("run", str(job), "--local", "-n", "1", "--run-dir", str(tmp_path / "run"), timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert f"{path}: sample" in out and "vocab_size is 6" in out and "IndexError" not in out, out[-3000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"loss"' not in metrics.read_text()


def test_a_tokenizer_pass_holds_bounded_memory_whatever_the_corpus_size(tmp_path):
    """12 MB of text through a tokenizer, in a fresh process: its peak RSS grows by far less than the text's
    130-220 bytes per byte that encoding it whole held (12 MB took 1.5 GB); the bound is a constant."""
    import random

    words = [f"w{i}" for i in range(500)]
    _sparse_tokenizer(tmp_path / "tok.json", {"[UNK]": 0, **{w: 5 + 7 * i for i, w in enumerate(words)}})
    rnd = random.Random(0)
    lines = (" ".join(rnd.choices(words, k=12)) + "\n" for _ in range(12 * 2**20 // 60))
    (tmp_path / "corpus.txt").write_text("".join(lines))
    probe = """
import resource, sys
from pathlib import Path
from hpcscale.data.prepare import prepare, load_tokenizer
src, out, tok = (Path(a) for a in sys.argv[1:])
load_tokenizer(tok)  # the library and numpy loaded: the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
prepare(src, out, tokenizer=tok)
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    files = [str(tmp_path / n) for n in ("corpus.txt", "ds", "tok.json")]
    r = subprocess.run([sys.executable, "-c", probe, *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after = (int(v) * 1024 for v in r.stdout.split())
    grown = after - before
    assert grown < 200 << 20, f"peak RSS grew by {grown >> 20} MiB over 12 MiB of text"
    assert read_manifest(tmp_path / "ds" / "manifest.json").dataset.samples == (12 * 2**20 // 60 * 12) // 257

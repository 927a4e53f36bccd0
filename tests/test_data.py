"""Data: prepare, the manifest's safety rules, the deterministic loader and its exact position."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
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

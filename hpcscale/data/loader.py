"""Deterministic sharded loading: each dp rank gets its slice of each global batch, in an order fixed by
(seed, epoch), and the position can be saved and restored exactly.

Sample space: every sample of the manifest's shards, in manifest order; the last `val_fraction` of them are
held out for validation. Global batch k of an epoch is `perm[k*B:(k+1)*B]` where perm is the permutation of
training samples drawn from numpy's PCG64 seeded with (seed, epoch); dp rank r takes positions
[r*B/dp, (r+1)*B/dp) of it. So the union over dp ranks is the same global batch at any dp.

Shards hold the manifest's `dataset.dtype` (uint8, uint16 or uint32; a manifest without one: uint16). Every
id of a batch is checked against the manifest's `vocab_size` before the batch is returned: a dataset whose
manifest understates its vocabulary (what a tokenizer with gaps in its ids once produced) is refused (BadInput,
exit 2) naming the manifest, the id and the sample, before that batch reaches a model (the first batch: before
the first step), never an index past the embedding. The check is one max over the batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcscale.data.manifest import read_manifest
from hpcscale.errors import BadInput
from hpcscale.portable import files
from hpcscale.util.bounded import file_problem


@dataclass(frozen=True, slots=True)
class LoaderState:
    epoch: int
    batch: int  # global batches consumed in this epoch


class TokenLoader:
    def __init__(
        self,
        manifest_path: Path,
        *,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        val_fraction: float = 0.0,
    ):
        m = read_manifest(manifest_path)
        if m.dataset is None:
            raise BadInput(f"{manifest_path}: has no token dataset (make one with hpcscale data prepare)")
        ds = m.dataset
        if seq_len + 1 > ds.sample_len:
            raise BadInput(
                f"{manifest_path}: samples hold {ds.sample_len} tokens; seq_len {seq_len} needs "
                f"{seq_len + 1} (prepare the data with a larger sample length)"
            )
        if global_batch % dp_size:
            raise BadInput(f"global_batch({global_batch}) is not a multiple of dp({dp_size})")
        root = manifest_path.parent
        self.seq_len, self.global_batch = seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.sample_len = ds.sample_len
        self.vocab_size = ds.vocab_size
        self.manifest_path = manifest_path
        self._shards = [_map_shard(root / s.path, np.dtype(ds.dtype), s.samples, ds.sample_len) for s in ds.shards]
        self._starts = np.cumsum([0] + [s.samples for s in ds.shards])
        n_val = int(ds.samples * val_fraction)
        self.n_train = ds.samples - n_val
        self.val_indices = np.arange(self.n_train, ds.samples)
        if self.n_train < global_batch:
            raise BadInput(
                f"{manifest_path}: {self.n_train} training samples, fewer than one global batch ({global_batch})"
            )
        self.batches_per_epoch = self.n_train // global_batch
        self.state = LoaderState(0, 0)
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n_train)
            self._perm_epoch = epoch
        return self._perm

    def _samples(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self._starts, indices, side="right") - 1
        rows = np.stack(
            [self._shards[s][i - self._starts[s], : self.seq_len + 1] for s, i in zip(shard, indices, strict=True)]
        )
        if rows.size and int(rows.max()) >= self.vocab_size:
            row = int(np.argmax(rows.max(axis=1)))
            raise BadInput(
                f"{self.manifest_path}: sample {int(indices[row])} holds token id {int(rows[row].max())}, but the "
                f"dataset's vocab_size is {self.vocab_size}: ids must be below it (prepare the data again with "
                "this hpcscale: it sizes the vocabulary to the tokenizer's largest id)"
            )
        rows = rows.astype(np.int64)
        return rows[:, :-1], rows[:, 1:]  # inputs (B, T), targets (B, T)

    def _local(self, batch_indices: np.ndarray) -> np.ndarray:
        per = len(batch_indices) // self.dp_size
        return batch_indices[self.dp_rank * per : (self.dp_rank + 1) * per]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """This dp rank's (inputs, targets) of the next global batch: (global_batch/dp, seq_len) each."""
        epoch, k = self.state.epoch, self.state.batch
        if k >= self.batches_per_epoch:
            epoch, k = epoch + 1, 0
        perm = self._permutation(epoch)
        indices = perm[k * self.global_batch : (k + 1) * self.global_batch]
        self.state = LoaderState(epoch, k + 1)
        return self._samples(self._local(indices))

    def val_batches(self, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The first `count` global batches of held-out samples (fewer if there are not that many)."""
        out = []
        for k in range(min(count, len(self.val_indices) // self.global_batch)):
            out.append(
                self._samples(self._local(self.val_indices[k * self.global_batch : (k + 1) * self.global_batch]))
            )
        return out

    @staticmethod
    def state_problem(state) -> str | None:
        """What is wrong with a saved state_dict() for load_state_dict (None: usable): "epoch" and "batch"
        non-negative integers and "seed", when present, an integer (a different seed is the user's choice,
        refused by load_state_dict with the two seeds named). ctx.checkpoint asks before loading a checkpoint,
        so a hand-edited state refuses that checkpoint and an older one is taken."""
        if not isinstance(state, dict):
            return f"the state is {type(state).__name__}, not an object with epoch, batch and seed"
        for key in ("epoch", "batch"):
            value = state.get(key)
            if type(value) is not int or value < 0:
                return f"{key} is {str(value)[:40]!r}, not a non-negative integer"
        if "seed" in state and type(state["seed"]) is not int:
            return f"seed is {str(state['seed'])[:40]!r}, not an integer"
        return None

    def skip(self, batches: int) -> None:
        """Move past the next `batches` global batches without reading them, as next_batch() would (across
        epochs): what a rollback after a loss spike skips (train.on_spike: rollback)."""
        if batches < 0:
            raise ValueError(f"skip({batches}): a number of batches is not negative")
        if batches == 0:
            return
        epoch, k = self.state.epoch, self.state.batch
        if k >= self.batches_per_epoch:
            epoch, k = epoch + 1, 0
        last = k + batches - 1  # the last batch skipped, counted from this epoch's first
        epoch, k = epoch + last // self.batches_per_epoch, last % self.batches_per_epoch + 1
        self.state = LoaderState(epoch, k)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "batch": self.state.batch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise BadInput(f"loader state was saved with seed {state['seed']}, this run uses {self.seed}")
        self.state = LoaderState(int(state["epoch"]), int(state["batch"]))


def _map_shard(path: Path, dtype: np.dtype, samples: int, sample_len: int) -> np.ndarray:
    """The shard at `path` mapped read-only as (samples, sample_len), from the descriptor checked: a regular file
    (a FIFO or a device is refused, never waited on) of exactly the size the manifest gives; BadInput naming the
    shard otherwise (a dataset others may write: a shorter or longer file is not the one the manifest lists)."""
    want = samples * sample_len * dtype.itemsize
    try:
        fd, st = files.open_regular(path)
    except OSError as e:
        raise BadInput(f"{path}: {file_problem(e, 'token shard')}") from None
    try:
        if st.st_size != want:
            raise BadInput(
                f"{path}: {st.st_size} bytes, but the manifest gives {samples} samples of {sample_len} "
                f"{dtype.name} tokens ({want} bytes); check the dataset with `hpcscale manifest verify`"
            )
        with open(fd, "rb", closefd=False) as f:
            return np.memmap(f, dtype=dtype, mode="r", shape=(samples, sample_len))
    finally:
        os.close(fd)

"""Checkpoints: sharded, HDF5-indexed, content-addressed incremental, async, atomic, verified, reshardable.
Format: docs/checkpoint-format.md."""

"""Datasets: manifests (shared with staging), corpus preparation, deterministic sharded loading."""

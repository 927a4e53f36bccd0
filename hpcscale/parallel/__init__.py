"""Parallel layout: DeviceMesh (pp, dp, tp), tensor parallelism (DTensor), pipelining, data-parallel gradient sync."""

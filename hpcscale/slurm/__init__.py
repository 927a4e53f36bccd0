"""Slurm: commands, template rendering and the run registry."""

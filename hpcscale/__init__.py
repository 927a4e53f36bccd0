"""hpcscale: Slurm/HPC-native training toolkit. See docs/user-guide.md."""

__version__ = "0.3.0"

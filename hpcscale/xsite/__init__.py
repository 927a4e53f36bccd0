"""Cross-site work: staging transports (stage), later contributions and averaging rounds."""

# `hpcscale stage` defaults, here rather than in channel.py so that the CLI can name them without loading it
DEFAULT_SSH = "ssh"  # --ssh (env HPCSCALE_SSH)
DEFAULT_REMOTE_PYTHON = "python3"  # --remote-python (env HPCSCALE_REMOTE_PYTHON)
DEFAULT_JOBS = 4  # -j, when neither the command line nor a site (staging.jobs) says

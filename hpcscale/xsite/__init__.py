"""Cross-site work: staging transports (stage), later contributions and averaging rounds."""

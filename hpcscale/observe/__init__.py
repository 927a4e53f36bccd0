"""What a run recorded, read back and judged: per-rank timing, stragglers, the checkpoint interval, reports."""

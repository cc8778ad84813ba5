"""History for people and tools: log, diff, per-tensor change words and summaries, read from the
commit graph."""

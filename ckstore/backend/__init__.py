"""Backends: where a repository's bytes live (a local folder with packs, or memory), key by key, with
the locks, atomic writes and fsyncs that make them durable."""

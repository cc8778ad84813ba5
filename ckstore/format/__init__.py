"""The on-disk format as pure data (no I/O): manifests, packs, ids, dtypes, settings, the DCP record;
docs/format.md is its specification."""

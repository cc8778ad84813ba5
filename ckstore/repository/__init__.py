"""The repository: its object store (verified reads, sources to read through), refs and reflogs,
commit graph, overlays and links."""

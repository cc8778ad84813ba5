"""Reading commits out: checkout and export to files, Hugging Face shards, merged LoRA adapters,
consolidated DCP saves, diffs against a folder."""

"""Byte-level codecs of stored objects (pure, no I/O): the object header and its encodings
(zstd, byte planes, XOR/difference deltas) in objects.py, predicted deltas in predicted.py, the
optimizer-aware predictors in predict.py. docs/format.md, sections 3-4, specifies them."""

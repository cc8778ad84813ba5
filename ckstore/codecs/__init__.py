"""Byte-level codecs of stored objects (pure, no I/O): the object header and its encodings
(zstd, byte planes, XOR/difference deltas, predicted deltas) in objects.py, the optimizer-aware
predictors in predict.py. docs/format.md, sections 3-4, specifies them."""

"""Compaction: after a commit is durable, its parent's chunks are re-encoded as deltas of its own.

compact.py runs a branch's pairs, pairing.py pairs chunk positions, encoding.py re-encodes one
position and checks it; finished_pairs.py and settled_raw.py remember work already done;
detached.py runs it in a process of its own that outlives the command.
"""

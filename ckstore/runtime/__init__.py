"""The ground floor of the process: how ckstore's work runs, shared by every layer above.

pipeline.py is the process-wide thread engine (bounded ordered maps, paused collection),
progress.py the protocol long operations report through, units.py sizes as people read them.
Nothing here knows about repositories; it imports nothing of ckstore's.
"""

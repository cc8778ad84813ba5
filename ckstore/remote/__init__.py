"""Remote repositories: a repository's layout on a transport (transport/) and the operations
between a local repository and it: push, fetch, clone, lazy reads, remote gc.

layout.py is the remote format (docs/format.md section 15); names.py the named remotes of a local
repository; push.py, fetch.py and landing.py move objects; gc.py, repack.py and supersede.py keep a
remote small; compaction.py re-encodes a commit's parent on the remote itself.
"""

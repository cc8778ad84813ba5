"""Maintenance of a repository: retention, gc (plan, then execute), repack, fsck and the size figures."""

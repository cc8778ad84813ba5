"""Byte counts for people (pure): one set of units everywhere (CLI, report, progress bars).

Its own module so that printing a size loads nothing else (`ckstore --help` imports it).
"""

from __future__ import annotations

# Binary (KiB, MiB, GiB; MiB/s), as the repository's limits are stated (format/settings.py).
UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; bytes below 1 KiB as a whole number."""
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

"""Byte counts for people, in one set of units everywhere: binary (KiB, MiB, GiB; MiB/s)."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; bytes below 1 KiB as a whole number."""
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

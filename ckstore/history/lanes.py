"""``log --graph``: git's lanes drawn in text, one column per line of history being followed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def graph_prefixes(commits: Sequence[tuple[str, Sequence[str]]]) -> Iterator[tuple[str, list[str]]]:
    """For each (id, parents) newest first: the prefix of its own line ("* | ") and the
    connector lines to print after it ("|/" where lanes join, "|\\" where a merge opens one).
    Parents not in ``commits`` (pruned, or beyond ``-n``) end their lane at the bottom."""
    shown = {oid for oid, _ in commits}
    lanes: list[str] = []
    for oid, parents in commits:
        if oid not in lanes:
            lanes.append(oid)
        here = lanes.index(oid)
        prefix = " ".join("*" if j == here else "|" for j in range(len(lanes)))
        after: list[str] = []
        kept = [p for p in parents if p in shown] or list(parents[:1])
        if not kept:
            lanes.pop(here)
        elif kept[0] in lanes:  # its parent is already followed: this lane joins that one
            other = lanes.index(kept[0])
            after.append(_connector(len(lanes), {max(here, other): "/"}))
            lanes[min(here, other)] = kept[0]
            lanes.pop(max(here, other))
        else:
            lanes[here] = kept[0]
        for extra in kept[1:]:  # a merge: one more lane, opening to the right
            if extra not in lanes:
                at = lanes.index(kept[0]) + 1
                lanes.insert(at, extra)
                after.append(_connector(len(lanes), {at: "\\"}))
        yield prefix, after


def _connector(width: int, bends: dict[int, str]) -> str:
    """A line between rows: "|" for each lane going straight down, a bend ("/" or "\\") between
    a lane and its left neighbour where it joins or leaves it."""
    chars = [" "] * (2 * width - 1)
    for j in range(width):
        if j in bends:
            chars[2 * j - 1] = bends[j]
        else:
            chars[2 * j] = "|"
    return "".join(chars).rstrip()

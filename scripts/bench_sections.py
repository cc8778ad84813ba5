"""Replace ``## Heading`` sections of docs/benchmarks.md, leaving the other scripts' sections."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace the section titled ``heading`` (up to the next ``## `` heading) or append it."""
    section = f"## {heading}\n\n{body.strip()}\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^## {re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def split_sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(what precedes the first ``## `` heading, [(heading, body)] in page order)."""
    parts = re.split(r"^## (.*)\n", text, flags=re.M)
    return parts[0], [(parts[i], parts[i + 1].strip("\n")) for i in range(1, len(parts), 2)]


def write_page(path: Path, intro: str, sections: Sequence[tuple[str, str]], drop: Sequence[str] = ()) -> None:
    """Write ``intro`` and ``sections`` (in this order) at the top of the page; keep every other
    section already on it, in its order, except headings starting with a string in ``drop``
    (sections this script wrote under older titles)."""
    old = split_sections(path.read_text())[1] if path.exists() else []
    mine = {heading for heading, _ in sections}
    kept = [(h, b) for h, b in old if h not in mine and not h.startswith(tuple(drop))]
    body = "\n\n".join(f"## {h}\n\n{b.strip()}" for h, b in [*sections, *kept])
    path.write_text(intro.rstrip("\n") + "\n\n" + body + "\n")

"""Replace one ``## Heading`` section of docs/benchmarks.md, leaving the other scripts' sections."""

from __future__ import annotations

import re
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

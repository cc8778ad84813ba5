"""Fixtures of the reliability suite, and the figures it reports (docs/reliability.md).

When ``CKSTORE_RELIABILITY_REPORT`` names a file, the counts the tests recorded (kills survived,
faults injected, bit flips detected, hostile inputs refused…) are merged into it as JSON at the
end of the session; ``scripts/reliability_report.py`` turns them into the doc's figures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import COUNTS
from .scenarios import Template, build_template


@pytest.fixture(scope="session", autouse=True)
def reliability_report() -> Iterator[None]:
    yield
    target = os.environ.get("CKSTORE_RELIABILITY_REPORT")
    if not target or not COUNTS:
        return
    path = Path(target)
    doc = json.loads(path.read_text()) if path.is_file() else {}
    for key, value in COUNTS.items():
        doc[key] = doc.get(key, 0) + value
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def small_template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """Three small commits, a tag, a branch, a checkout target: copied afresh before every run."""
    return build_template(tmp_path_factory.mktemp("small"), 1536, (1, 2, 3))

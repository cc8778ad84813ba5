"""Fixtures of the reliability suite, and the figures it reports (docs/reliability.md).

When ``CKSTORE_RELIABILITY_REPORT`` names a file, the counts the tests recorded (kills survived,
faults injected, bit flips detected, hostile inputs refused…) are merged into it as JSON at the
end of the session; ``scripts/reliability_report.py`` turns them into the doc's figures. Under
pytest-xdist every worker ends its own session and merges its counts, one at a time (flock).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator

import pytest

from .helpers import COUNTS
from .scenarios import Template, build_template


@pytest.fixture(scope="session", autouse=True)
def reliability_report() -> Iterator[None]:
    yield
    target = os.environ.get("CKSTORE_RELIABILITY_REPORT")
    if not target or not COUNTS:
        return
    with open(target, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        doc = json.loads(text) if text else {}
        for key, value in COUNTS.items():
            doc[key] = doc.get(key, 0) + value
        f.seek(0)
        f.truncate()
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def small_template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """Three small commits, a tag, a branch, a checkout target: copied afresh before every run."""
    return build_template(tmp_path_factory.mktemp("small"), 1536, (1, 2, 3))

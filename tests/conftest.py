"""Fixtures shared by the core-store tests, and the hypothesis profiles of the whole suite."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from ckstore.repo import Repo

# Profiles are loaded here, before any test module builds its own settings on top of the default.
# "ci": every run draws the same examples (derandomize) and remembers none (database=None), so a
# CI result depends only on the code; a failure prints the blob that replays it with
# @reproduce_failure. Timing can never fail a test on a loaded 2-core box: no deadline, no
# too_slow health check (the other health checks are deterministic once derandomized).
# "dev" (default): fresh random examples every run, failures kept in .hypothesis/ and replayed first.
settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
_CI = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if _CI else "dev")
settings.load_profile(PROFILE)


def pytest_report_header() -> str:
    return f"hypothesis profile: {PROFILE} (CI={os.environ.get('CI', '')!r})"


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    """An empty on-disk repository with small chunks, so small test tensors span several chunks."""
    return Repo.init(tmp_path / "repo", chunk_size=4096)


@pytest.fixture(autouse=True)
def _reset_torch_determinism() -> Iterator[None]:
    """Lightning's ``deterministic=True`` switches torch's deterministic mode on process-wide; it
    would leak into later tests (torch.empty then fails for float4), so switch it back off."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)

"""Run the reliability suite and write its figures into docs/reliability.md.

    python scripts/reliability_report.py [extra pytest args…]

The tests count what they did (kills survived, faults injected, bit flips detected, hostile inputs
refused…) into the JSON file named by CKSTORE_RELIABILITY_REPORT; this script runs them with that
variable set, then replaces the block between the ``figures`` markers of docs/reliability.md.
It exits with pytest's status, and leaves the doc untouched when the suite failed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
START, END = "<!-- figures:start -->", "<!-- figures:end -->"

ROWS = [
    ("SIGKILL at every write step, survived", ["kills_every_step"]),
    ("SIGKILL at random moments, survived", ["kills_random"]),
    ("Ctrl-C at a chosen call / at a random moment, one line at most", ["ctrl_c_at_a_call", "ctrl_c_at_random"]),
    ("stale ref locks left by kills, broken by the next ref update", ["stale_ref_locks_broken", "stale_locks_broken"]),
    ("stale locks of an older ckstore, reported with the remedy", ["stale_locks_reported"]),
    ("checkout temporaries left by kills, removed by the next checkout", ["checkout_temporaries_left_by_kills"]),
    ("ENOSPC injected (every step of every command)", ["faults_enospc"]),
    ("EIO injected (every step of every command)", ["faults_eio"]),
    ("bit flips detected (hypothesis)", ["bit_flips_detected"]),
    ("bit flips that left the decoded bytes intact (harmless)", ["bit_flips_harmless"]),
    ("truncated objects detected", ["truncations_detected"]),
    ("missing objects detected", ["missing_objects_detected"]),
    ("golden damaged repositories matched", ["golden_repositories_checked"]),
    ("hostile inputs refused with their specific error", ["hostile_inputs_refused"]),
    ("path-like tensor names that stayed harmless", ["hostile_names_harmless"]),
    ("concurrent commits (all kept) / gc runs meanwhile", ["concurrent_commits", "concurrent_gc_runs"]),
    ("CAS rounds with exactly one winner", ["cas_rounds"]),
    (
        "stateful test: commits / gc runs / corruptions / verified checkouts",
        ["stateful_commits", "stateful_gcs", "stateful_corruptions", "stateful_checkouts"],
    ),
    (
        "randomized system test: operations / SIGKILLs / verified bit-exact",
        [
            "system test: operations",
            "system test: SIGKILLs",
            "system test: acknowledged commits and pushes verified bit-exact",
        ],
    ),
    (
        "bounded soak: operations / SIGKILLs / Ctrl-C / commits refused with ENOSPC",
        [
            "soak (bounded): operations",
            "soak (bounded): SIGKILLs",
            "soak (bounded): Ctrl-C",
            "soak (bounded): commits refused with ENOSPC",
        ],
    ),
    ("source files scanned for pickle", ["no_pickle_files_scanned"]),
]


def render(counts: dict[str, int], seconds: float, status: str) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        START,
        f"Last run: {when}, {status}, {seconds / 60:.1f} min on {os.cpu_count()} cores "
        f"(Python {platform.python_version()}).",
        "",
        "| what | count |",
        "|---|---|",
    ]
    for label, keys in ROWS:
        lines.append(f"| {label} | {' / '.join(str(counts.get(k, 0)) for k in keys)} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, CKSTORE_RELIABILITY_REPORT=str(report))
        start = time.monotonic()
        status = subprocess.call([sys.executable, "-m", "pytest", "-q", "tests/reliability", *argv], cwd=ROOT, env=env)
        seconds = time.monotonic() - start
        counts = json.loads(report.read_text()) if report.is_file() else {}
    if status != 0:
        print(f"reliability suite failed (exit {status}); docs/reliability.md not updated", file=sys.stderr)
        return status
    text = DOC.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    DOC.write_text(head + render(counts, seconds, "all passed") + tail)
    print(json.dumps(counts, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

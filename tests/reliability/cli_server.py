"""``python tests/reliability/cli_server.py``: many ``ckstore`` commands in one process, for the soak.

Each request is one JSON line on stdin, ``{"args": [...], "pack_min_bytes": N | null}``; the
command runs through the CLI's own entry (``ckstore.cli.base.main``: argument parsing, the
command, its error handling and exit code) with stdout and stderr captured, and the answer is one
JSON line on stdout, flushed: ``{"code": N, "out": "...", "err": "..."}``. An answer read in full
is the command's end (system.py SIGKILLs this process at random moments, so a command cut short
has no answer). Starting the interpreter and importing ckstore costs more CPU than a small command
itself; a process that serves several commands lets the long soak reach ten thousand operations
on a shared two-core machine, while a share of the commands (and every Ctrl-C) still runs in a
process of its own (tests/fault_cli.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout under test

from ckstore.backend.local import LocalBackend  # noqa: E402
from ckstore.cli.base import main as ckstore_main  # noqa: E402
from ckstore.write.background import BackgroundWork  # noqa: E402

# As tests/fault_cli.py: the compaction after a commit stays in this process, so a kill can land in it.
BackgroundWork.detach_compaction = property(lambda self: False, lambda self, value: None)  # type: ignore[assignment]
DEFAULT_PACK_MIN_BYTES = LocalBackend.pack_min_bytes


def serve(request: dict[str, Any]) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    pack_min = request.get("pack_min_bytes")
    LocalBackend.pack_min_bytes = DEFAULT_PACK_MIN_BYTES if pack_min is None else int(pack_min)
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ckstore_main(args=request["args"], prog_name="ckstore", standalone_mode=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # noqa: BLE001  (the harness reports a traceback as a failure)
            err.write(traceback.format_exc())
            code = 1
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def main() -> None:
    for line in sys.stdin:
        sys.stdout.write(json.dumps(serve(json.loads(line))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

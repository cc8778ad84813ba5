"""ckstore: a content-addressed, deduplicating checkpoint store for PyTorch training."""

# Every ``ckstore.*`` import runs this file first, the ckstore command's included, so it imports
# only what the interpreter has loaded already (no import machinery runs) and its names load on
# first use: ``ckstore --help`` needs no repository code, and the RNG helpers need torch.
import os
import sys

TYPE_CHECKING = False  # typing is not loaded yet (see above); mypy reads this name as typing's
if TYPE_CHECKING:
    import signal as _signal

    from ckstore.errors import CkstoreError, IntegrityError
    from ckstore.repo import Repo
    from ckstore.training.state import rng_state, set_rng_state
    from ckstore.version import __version__
else:
    import _signal  # built in

__all__ = ["CkstoreError", "IntegrityError", "Repo", "__version__", "rng_state", "set_rng_state"]


def _interrupted_while_starting(signum: int, frame: object) -> None:
    # The ckstore command before its own handler is in place (ckstore/cli/__init__.py): nothing
    # has been read or written yet, so leaving at once is safe.
    try:
        os.write(2, b"ckstore: interrupted\n")
    except OSError:
        pass  # stderr closed: the exit code says it
    os._exit(130)


def _launched_as_command() -> bool:
    """This process is the ``ckstore`` console script, whose first statement imports ckstore.cli
    (pip's launcher; on Windows its name ends in ``-script.py`` or ``.exe``)."""
    name = os.path.basename((getattr(sys, "argv", None) or [""])[0])
    for suffix in ("-script.pyw", "-script.py", ".exe"):
        name = name.removesuffix(suffix)
    return name == "ckstore"


# Ctrl-C during the command's start-up: one line and exit 130 from ckstore's very first line,
# not a traceback from inside the imports. A program that merely imports ckstore is left alone.
if _launched_as_command() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)


def __getattr__(name: str) -> object:
    if name == "Repo":
        from ckstore.repo import Repo

        return Repo
    if name in ("CkstoreError", "IntegrityError"):
        from ckstore import errors

        return getattr(errors, name)
    if name == "__version__":
        from ckstore.version import __version__

        return __version__
    if name in ("rng_state", "set_rng_state"):
        from ckstore.training import state

        return getattr(state, name)
    raise AttributeError(f"module 'ckstore' has no attribute {name!r}")

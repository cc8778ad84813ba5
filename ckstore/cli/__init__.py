"""The ``ckstore`` command: parse arguments, call ``Repo``, print. No storage work happens here.

Commands live in one module per group (files, inspect, refs, maintenance, overlays, overview, remotes); the
group in base.py imports a module when one of its commands runs or is listed (``COMMAND_MODULES``).

Ctrl-C. The command has one SIGINT handler for its whole life, ``CTRL_C``, installed by ``run``
before anything heavy is imported, and it acts by phase rather than being swapped for others, so
there is no moment when Python's own handler could print a traceback. Before it (while the
console script imports this module) ``ckstore/__init__.py``'s start-up handler does the same as
its first phase. This file, like that one, imports only what the interpreter has loaded already.

- starting (arguments parsed, modules imported): nothing has been read or written, so it says
  ``ckstore: interrupted`` and leaves at once, exit 130;
- running (the command): the first Ctrl-C stops it (KeyboardInterrupt: exit 130, one line), or is
  held when the command has recorded its one commit (``hold``); later ones are ignored while the
  command unwinds, so none lands in its clean-up;
- standing (a commit printed, the command finishing): it says that the commit stands, once;
- ending (the outcome decided: output flushed, exit hooks, exit): SIGINT is ignored.

A Ctrl-C during the interpreter's own start-up (before ckstore's first line: Python's ``site``,
the console script's ``import re``) reaches Python's handler, which ckstore cannot replace earlier.
"""

import _thread
import os

from ckstore import TYPE_CHECKING, _interrupted_while_starting

if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Callable
else:
    import _signal  # built in and loaded by the interpreter already: no import machinery runs

EXIT_INTERRUPTED = 130

STARTING, RUNNING, STOPPING, STANDING, ENDING = range(5)


class CtrlC:
    """The ckstore command's SIGINT handler (see the module docstring). Everything it does is
    safe between any two bytecodes: it takes no lock, and it writes with one ``os.write``."""

    def __init__(self) -> None:
        self.phase = STARTING
        # While running: true once Ctrl-C should be held rather than raised (pass_repo sets it).
        self.hold: Callable[[], bool] | None = None
        self.held = False
        self.standing_note = b""
        self.again = False  # a Ctrl-C swallowed by a finalizer is being delivered again
        self.in_hook = False

    def __call__(self, signum: int, frame: object) -> None:
        phase = self.phase
        if phase == STARTING:
            _interrupted_while_starting(signum, frame)
        if phase == RUNNING:
            if self.in_hook:
                return  # inside ``swallowed``: raised there it would be swallowed again
            self.again = False
            hold = self.hold
            if hold is not None and hold():
                self.held = True
                return
            self.phase = STOPPING
            raise KeyboardInterrupt
        if phase == STANDING:
            self.phase = ENDING
            _say(self.standing_note)
        # STOPPING, ENDING: ignored

    def swallowed(self) -> None:
        """A Ctrl-C that landed in a finalizer (a ``__del__``, a weakref callback, a generator
        being closed) was swallowed there by Python (``sys.unraisablehook``, which calls this from
        inside that finalizer): without more, the command would not stop, and would ignore every
        later Ctrl-C. It is delivered again, to the code that runs next, from a thread that
        repeats it until it lands outside the hook (and, should it land in a finalizer again,
        this comes back here)."""
        import threading
        import time

        def deliver() -> None:
            while self.again:
                _thread.interrupt_main()
                time.sleep(0.002)

        self.in_hook = True
        try:
            self.phase = RUNNING
            self.again = True
            threading.Thread(target=deliver, name="ckstore-ctrl-c", daemon=True).start()
        finally:
            self.in_hook = False

    def active(self) -> bool:
        """This process is the ckstore command and the handler is in place."""
        return _signal.getsignal(_signal.SIGINT) is self

    def install(self) -> None:
        """Take SIGINT, unless someone other than Python or ckstore's start-up set it (``nohup``,
        a shell that starts background jobs with it ignored, a wrapper with a handler of its own)."""
        if _signal.getsignal(_signal.SIGINT) in (_signal.default_int_handler, _interrupted_while_starting):
            _signal.signal(_signal.SIGINT, self)

    def run(self) -> None:
        """The command starts doing its work: Ctrl-C now stops it."""
        if self.phase == STARTING:
            self.phase = RUNNING

    def stand(self, note: str) -> None:
        """The command has recorded and printed its commit: Ctrl-C says ``note`` (once)."""
        self.standing_note = f"{note}\n".encode()
        self.hold = None
        if self.phase in (RUNNING, STOPPING):
            self.phase = STANDING
        if self.held:
            self.held = False
            self(_signal.SIGINT, None)

    def finish(self) -> None:
        """The command returned: nothing is left to stop, though a commit may still be said."""
        self.hold = None
        if self.phase in (STARTING, RUNNING):
            self.phase = ENDING

    def end(self) -> None:
        """The outcome is decided: from here to the exit (flushing, exit hooks) Ctrl-C is ignored."""
        self.phase = ENDING
        self.hold = None
        if self.active():
            _signal.signal(_signal.SIGINT, _signal.SIG_IGN)


def _say(line: bytes) -> None:
    try:
        os.write(2, line)
    except OSError:
        pass  # stderr closed or full: the exit code says it


CTRL_C = CtrlC()


def run() -> None:
    """The ``ckstore`` command (pyproject.toml [project.scripts])."""
    CTRL_C.install()  # before anything heavy is imported
    from ckstore.cli.base import run as run_command

    run_command()


def __getattr__(name: str) -> object:
    if name == "main":
        from ckstore.cli.base import main

        return main
    raise AttributeError(f"module 'ckstore.cli' has no attribute {name!r}")


__all__ = ["CTRL_C", "EXIT_INTERRUPTED", "main", "run"]

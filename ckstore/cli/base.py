"""What every command shares: the group, error handling, repository lookup, output helpers.

Errors are the contract: every ``CkstoreError`` becomes ``ckstore: <one line>`` on stderr and its
class's exit code (see errors.py); no traceback reaches the user.

A command returns once its commit is durable: the compaction after a commit runs in a detached
process (``Repo.detach_compaction``, compaction/detached.py) that ``ckstore wait`` waits for. Ctrl-C
before a commit is durable cancels it (exit 130; the ref is unchanged, no temporary file is
left, and chunks already stored are unreferenced until gc); once a command has printed its
commit, Ctrl-C only says that the commit stands (exit 0). After the first Ctrl-C, further ones
are ignored while the command cleans up, so none prints a traceback. One handler does all this
for the whole process, by phase (``ckstore.cli.CTRL_C``, ckstore/cli/__init__.py).
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from contextlib import suppress
from functools import update_wrapper
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import click

from ckstore.cli import CTRL_C, EXIT_INTERRUPTED, STOPPING
from ckstore.errors import CkstoreError, CkstoreWarning, InvalidInputError, OutputError, StorageError
from ckstore.runtime.units import human  # noqa: F401  (the commands' one way to print sizes)

# The repository layer loads when a command opens a repository (``find_repo``), not for ``--help``
# or a usage error (start-up: scripts/bench_startup.py, tests/cli/test_startup.py).
if TYPE_CHECKING:
    import click.shell_completion

    from ckstore.repo import ProgressBar, Repo

EXIT_PIPE = 141  # 128 + SIGPIPE
INTERRUPT_NOTE = "ckstore.interrupt_note"  # click context meta: a command's words for an interrupted run


def die(message: str, code: int) -> NoReturn:
    CTRL_C.finish()  # the outcome is this message: a Ctrl-C now would only add a second line
    try:
        click.echo(f"ckstore: {message}", err=True)
    except OSError:
        pass  # stderr is closed or full too: the exit code is all that can say it
    sys.exit(code)


def parse_meta_value(text: str) -> Any:
    """``--meta`` values are typed: ints and floats stay numbers, true/false booleans, else str."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_meta(pairs: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"--meta expects KEY=VALUE, got {pair!r}")
        out[key] = parse_meta_value(value)
    return out


# A bar appears only once an operation has run this long: quick commands stay quiet.
PROGRESS_DELAY = 0.5


def progress_factory() -> Callable[[int, str], ProgressBar] | None:
    # stderr is None when the command was started with that descriptor closed (cron, ``2>&-``).
    if sys.stderr is None or not sys.stderr.isatty():
        return None
    return binary_bar


def binary_bar(total: int, desc: str) -> ProgressBar:
    """A tqdm bar in the units the rest of the CLI prints (KiB, MiB, GiB and MiB/s): tqdm's own
    scaling labels binary numbers "M"/"G" and its rate in decimal "MB/s"."""
    from tqdm import tqdm

    class BinaryBar(tqdm):
        @property
        def format_dict(self) -> dict[str, Any]:
            d = super().format_dict
            rate = d["rate"] or (d["n"] / d["elapsed"] if d["elapsed"] else None)
            d.update(done=human(d["n"]), size=human(d["total"] or 0), speed=f"{human(rate)}/s" if rate else "…/s")
            return d

    # total 0: not known in advance (fetch): bytes so far and their rate, without a bar.
    return BinaryBar(
        total=total or None,
        desc=desc,
        file=sys.stderr,
        leave=False,
        delay=PROGRESS_DELAY,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {done} / {size} [{elapsed}<{remaining}, {speed}]"
        if total
        else "{desc}: {done} [{elapsed}, {speed}]",
    )


def json_safe(value: Any) -> Any:
    """JSON has no NaN or infinities: they become the strings "NaN", "Infinity", "-Infinity"
    (docs/cli-json.md), which ``float()`` reads back."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def print_json(doc: Any) -> None:
    """Every ``--json`` document goes through here: strict JSON (RFC 8259), whatever the data."""
    click.echo(json.dumps(json_safe(doc), indent=2, ensure_ascii=False, allow_nan=False, default=str))


def short(oid: str) -> str:
    return oid[:12]


class _StandardOutput:
    """stdout as the command writes it: a failed write or flush (``> /dev/full``, an I/O error)
    becomes OutputError, one line and exit 7, naming standard output (an OSError there names
    no file); a reader that went away stays BrokenPipeError (``output_closed``). Started with
    stdout closed, every write fails the same way instead of vanishing."""

    def __init__(self, stream: TextIO | None) -> None:
        self._closed = self.closed_at_start = stream is None
        # Closed: the attributes click reads (encoding, isatty) come from /dev/null's stream.
        self._stream: TextIO = stream if stream is not None else open(os.devnull, "w")  # noqa: SIM115

    def _failed(self, exc: OSError | None) -> NoReturn:
        why = "it is closed" if exc is None else (exc.strerror or str(exc))
        raise OutputError(f"cannot write to standard output: {why}")

    def write(self, text: str) -> int:
        if self._closed and text:
            self._failed(None)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            self._failed(exc)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            self._failed(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _drop_output() -> None:
    """After a failed write of stdout: what is still buffered goes to /dev/null, so that the
    final flush neither fails again nor says it twice."""
    stream = sys.stdout
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, io.UnsupportedOperation, AttributeError):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process


def output_closed() -> NoReturn:
    """The reader of our output went away (``ckstore log | head -1``): not an error to report.
    stdout is pointed at /dev/null so the interpreter's final flush cannot fail again, and the
    exit code is a closed pipe's, as git's (the shell shows nothing for it)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        pass  # not a real file (tests capture output in memory): nothing will flush to a pipe
    sys.exit(EXIT_PIPE)


def show_warnings(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        if issubclass(w.category, CkstoreWarning):
            click.echo(f"ckstore: warning: {w.message}", err=True)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


_COUNT = re.compile(r"-[0-9]+")
_COUNTED = ("log", "reflog")  # the commands that take git's -N for -n N


def git_count_args(args: list[str]) -> list[str]:
    """git's ``log -3``: ``-N`` after log or reflog becomes ``-n N`` (click has no such option)."""
    command = next(
        (i for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "--repo")), None
    )
    if command is None or args[command] not in _COUNTED:
        return args
    out = args[: command + 1]
    for arg in args[command + 1 :]:
        out += ["-n", arg[1:]] if _COUNT.fullmatch(arg) else [arg]
    return out


# The module (ckstore/cli/<module>.py) that defines each command, imported when that command
# runs or a help text lists it: `ckstore log` loads only the history commands (start-up).
# tests/cli/test_startup.py checks that this names every command and its module.
COMMAND_MODULES = {
    **dict.fromkeys(("init", "commit", "checkout", "export", "import"), "files"),
    **dict.fromkeys(("log", "show", "diff", "best", "stats"), "inspect"),
    **dict.fromkeys(("gc", "repack", "config", "fsck"), "maintenance"),
    "relink": "overlays",
    **dict.fromkeys(("status", "report"), "overview"),
    **dict.fromkeys(("branch", "tag", "switch", "reset", "reflog"), "refs"),
    **dict.fromkeys(("remote", "push", "fetch", "pull", "clone"), "remotes"),
}


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMAND_MODULES})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMAND_MODULES:
            importlib.import_module(f"ckstore.cli.{COMMAND_MODULES[name]}")  # registers its commands
        return super().get_command(ctx, name)

    # click declares main() as overloads on ``standalone_mode``; this override fixes that mode
    # (errors always end in one line and an exit), so one plain signature serves every caller.
    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:  # type: ignore[override]
        """Usage errors as every other error: one line ``ckstore: …`` (README, "Commands"), exit 2."""
        argv = git_count_args(list(sys.argv[1:] if args is None else args))
        extra.pop("standalone_mode", None)
        try:
            super().main(argv, prog_name, standalone_mode=False, **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "ckstore"
            die(f"{exc.format_message().rstrip('.')} (see '{where} --help')", exc.exit_code)
        except click.exceptions.Abort:
            die("interrupted", EXIT_INTERRUPTED)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            die(exc.format_message(), exc.exit_code)
        sys.exit(0)

    def invoke(self, ctx: click.Context) -> Any:
        CTRL_C.run()  # the command starts its work: from here Ctrl-C stops it
        try:
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", CkstoreWarning)
                    result = super().invoke(ctx)
                show_warnings(caught)
                # Done: a Ctrl-C from here on would report "interrupted" for work that is complete.
                CTRL_C.finish()
                return result
            except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
                CTRL_C.finish()  # what main() reports next is the outcome
                raise  # click's own ends of a command (--help, usage errors): main() reports them
            except Exception as exc:  # noqa: BLE001 - every failure is one line, a bug of ours too
                report_failure(exc)
        except KeyboardInterrupt:  # also one raised while a failure was being reported: one line
            die("interrupted", EXIT_INTERRUPTED)


def report_failure(exc: Exception) -> NoReturn:
    """A command's failure as one line and its exit code."""
    if _caused_by_ctrl_c(exc):
        die("interrupted", EXIT_INTERRUPTED)
    if isinstance(exc, BrokenPipeError):
        output_closed()
    if isinstance(exc, OutputError):
        _drop_output()
        die(str(exc), exc.exit_code)
    if isinstance(exc, CkstoreError):
        die(str(exc), exc.exit_code)
    if isinstance(exc, OSError):
        die(str(StorageError(f"{exc.strerror or exc}: {exc.filename or ''}")), StorageError.exit_code)
    if isinstance(exc, MemoryError):
        die("out of memory", 1)
    die(f"internal error: {type(exc).__name__}: {exc} (please report it)", 1)


def _caused_by_ctrl_c(exc: BaseException) -> bool:
    """A Ctrl-C that Python turned into another exception on its way out: raised while a class
    was being made, it becomes RuntimeError("Error calling __set_name__ …") in Python 3.11; raised
    in clean-up code, the error that clean-up then hit."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def complete_ref(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[click.shell_completion.CompletionItem]:
    """Shell completion of REF arguments: branches, tags and HEAD of the repository in use
    (``eval "$(_CKSTORE_COMPLETE=bash_source ckstore)"``; README, "Shell completion")."""
    try:
        repo = find_repo(ctx)
        names = ["HEAD", *repo.branches(), *repo.tags()]
    except CkstoreError:
        return []  # outside a repository there is nothing to offer, and completion must not fail
    import click.shell_completion  # here: only completion needs it

    return [click.shell_completion.CompletionItem(n) for n in sorted(set(names)) if n.startswith(incomplete)]


# The commands that record one commit: once it is recorded, all that is left is printing it, so a
# Ctrl-C is held until the command ends, the id printed and the exit 0. A command that records
# several (``import``) is stopped: the ones recorded stand, and the message names them (exit 130).
SINGLE_COMMIT = ("commit",)


COMMIT_STANDS = "ckstore: the commit stands; its compaction continues in the background ('ckstore wait' waits for it)"


def find_repo(ctx: click.Context) -> Repo:
    """The repository of ``--repo``, $CKSTORE_REPO or the nearest .ckstore."""
    from ckstore.repo import Repo

    return Repo.find(ctx.find_root().params.get("repo_path"))


def pass_repo(f: Callable[..., Any]) -> Callable[..., Any]:
    """Find the repository when the command runs (so `ckstore CMD --help` works anywhere)."""

    @click.pass_context
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        repo = find_repo(ctx)
        # The command ends when its commit is durable; compaction goes on without it.
        repo.detach_compaction = True
        repo.fork_compaction = _OWN_PROCESS  # the ckstore command: its compaction may be a fork of it
        own = CTRL_C.active()
        if own and ctx.info_name in SINGLE_COMMIT:
            # Asked inside the signal handler: commits_recorded takes no lock and does no I/O.
            CTRL_C.hold = lambda: bool(repo.commits_recorded())
        try:
            result = ctx.invoke(f, repo, *args, **kwargs)
        except OutputError as exc:
            recorded = repo.commits_recorded()
            if not recorded:
                raise
            _drop_output()
            if ctx.info_name not in SINGLE_COMMIT:  # stopped before the rest of its work
                die(f"{exc}; commit {recorded[-1]} was recorded and stands (the rest was not done)", exc.exit_code)
            # The command's work is done: printing its id was all that was left. It is said on
            # stderr, and the exit is 0, so a script retrying on failure does not record it twice;
            # a caller that closed stdout asked for silence.
            if not isinstance(sys.stdout, _StandardOutput) or not sys.stdout.closed_at_start:
                with suppress(OSError):
                    click.echo(f"ckstore: warning: {exc}; commit {recorded[-1]} was recorded", err=True)
            return None
        except KeyboardInterrupt:
            recorded = repo.commits_recorded()
            if not recorded:
                raise
            landed = f"commit {recorded[0]}" if len(recorded) == 1 else f"{len(recorded)} commits (last {recorded[-1]})"
            note = ctx.meta.get(INTERRUPT_NOTE, "")  # what the command adds (import: was the source deleted)
            die(
                f"interrupted after {landed} was recorded: it stands{note}, and its compaction continues in the"
                " background ('ckstore wait' waits for it)",
                EXIT_INTERRUPTED,
            )
        if own and repo.commits_recorded():
            CTRL_C.stand(COMMIT_STANDS)  # says it now if a Ctrl-C was held meanwhile
        CTRL_C.hold = None
        repo.wait()  # background work of this process (none from a command: a safeguard)
        return result

    return update_wrapper(wrapper, f)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--repo", "repo_path", metavar="PATH", help="Repository (default: $CKSTORE_REPO, else the nearest .ckstore)."
)
@click.version_option(package_name="ckstore")
@click.pass_context
def main(ctx: click.Context, repo_path: str | None) -> None:
    """ckstore: a content-addressed, deduplicating store for training checkpoints."""


@main.command(name="wait")
@pass_repo
def wait_command(repo: Repo) -> None:
    """Wait until the compaction after recent commits has finished (it runs detached)."""
    repo.wait_background()


# Set by ``run`` (the ckstore command): the process is ours (its compaction may be a fork of it, and
# SIGINT is handled as the module docstring says). Called in-process (tests, click's runner),
# Python's handler stays.
_OWN_PROCESS = False


def run() -> None:
    global _OWN_PROCESS
    _OWN_PROCESS = True
    # Before numpy is imported: its BLAS otherwise starts a thread per core that spins while
    # numpy loads (0.06-0.08 CPU s of a 0.1-0.2 s import, a tenth of a small commit). The command
    # makes no BLAS call that more threads would speed up; a user's own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A TextIO stand-in, not a TextIO subclass: it forwards what it does not wrap.
    sys.stdout = _StandardOutput(sys.stdout)  # type: ignore[assignment,unused-ignore]
    sys.unraisablehook = _unraisable
    try:
        try:
            main(prog_name="ckstore", standalone_mode=True)
            code = 0
        finally:
            CTRL_C.end()  # the outcome is decided: no Ctrl-C changes it now
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # another handler than ours raised it (a wrapper's)
        code = EXIT_INTERRUPTED
        with suppress(OSError, ValueError, AttributeError):
            print("ckstore: interrupted", file=sys.stderr)
    code = _flushed(code)  # output still buffered when the command returned
    # The command is over: everything it wrote is flushed, closed or durable, and its background
    # work waited for (pass_repo) or detached. Tearing down the interpreter (every module and
    # object freed one by one) would add 0.05-0.1 s to every command, a tenth of a small commit;
    # the exit hooks others registered (a wrapper's report) still run. Under a profiler or a
    # tracer (cProfile, coverage), which report after the program returns, it exits as usual.
    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)
    atexit._run_exitfuncs()
    os._exit(_flushed(code))


def _unraisable(unraisable: Any) -> None:
    """Python's last resort for an exception it cannot raise (one in a finalizer)."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt) and CTRL_C.phase == STOPPING:
        CTRL_C.swallowed()  # our Ctrl-C: it must still stop the command
        return
    sys.__unraisablehook__(unraisable)


def _flushed(code: int) -> int:
    """Flush stdout and stderr; ``code``, or EXIT_PIPE when a reader closed the pipe. A stream
    is None when the command was started with that descriptor closed: nothing to flush."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except BrokenPipeError:
        return EXIT_PIPE
    except OutputError as exc:  # what a command printed last, flushed only now
        _drop_output()
        if sys.stderr is not None:
            print(f"ckstore: {exc}", file=sys.stderr)
        return code or exc.exit_code
    return code

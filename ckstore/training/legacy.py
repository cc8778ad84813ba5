"""Safe import of legacy PyTorch pickle checkpoints (``.pth``, ``.pt``, ``.bin``, ``.ckpt``).

Pickle can run arbitrary code, so a checkpoint is only ever read with torch's restricted
unpickler: ``torch.load(weights_only=True)``, which accepts tensors, containers and plain values
and refuses every other global. There is deliberately no fallback to full unpickling: a file the
restricted unpickler refuses is reported, naming the global it wanted, and nothing else happens.
``weights_only`` became safe enough to rely on (and the default) in torch 2.6, so older torch is
refused.

Zip-format files (every ``torch.save`` since 1.6) are memory-mapped (``mmap=True``), so memory is
bounded by what the commit touches, not by the file size; the legacy non-zip format cannot be
mapped and is read into memory, still restricted. Each file becomes one commit through
``commit_state`` (the pickle-free training-state encoding). With ``delete_source`` a file is
deleted only after its commit has been read back, chunk hashes verified, and every tensor and
value compared with what was loaded from the file.

torch is imported lazily: ``import ckstore`` and the rest of the CLI stay torch-free.
"""

from __future__ import annotations

import os
import pickletools
import re
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from ckstore.errors import (
    IntegrityError,
    InvalidInputError,
    MissingDependencyError,
    SafetensorsFormatError,
    UnsafeCheckpointError,
)

SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
MIN_TORCH = (2, 6)
_PICKLE_PROTO = b"\x80"  # pickle's PROTO opcode, first in every protocol 2+ pickle
_ZIP_MAGIC = b"PK\x03\x04"  # torch's own _is_zipfile test: zip files start with a local header
# torch's messages: "Unsupported global: GLOBAL foo.Bar was not an allowed global by default" and
# "Trying to load unsupported GLOBAL posix.system whose module posix is blocked".
_GLOBAL = re.compile(r"GLOBAL\s+([^\s,;]+?)(?:\s|$|,|;)")
# torch's unpickler stops at the first opcode it lacks (STACK_GLOBAL, INST, OBJ, EXT1, FRAME…).
_OPERAND = re.compile(r"Unsupported operand (\d+)")
# A legacy (non-zip) file is five pickles in a row (magic number, protocol, system info, the
# object, storage keys), then raw storage bytes.
_LEGACY_PICKLES = 5


@dataclass(frozen=True)
class ImportResult:
    source: Path
    commit: str
    deleted: bool


def check_torch_version(version: str) -> None:
    """Refuse torch older than 2.6, whose ``weights_only`` loader is not trustworthy."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) < MIN_TORCH:
        raise MissingDependencyError(
            f"importing pickle checkpoints needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} for a safe"
            f" weights_only load; this is torch {version} (upgrade torch)"
        )


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("importing pickle checkpoints needs torch >= 2.6 (pip install torch)") from None
    check_torch_version(torch.__version__)
    return torch


def find_checkpoints(path: Path, recursive: bool, exclude: Path | None = None) -> list[tuple[Path, str]]:
    """(file, name for messages) pairs: ``path`` itself, or each checkpoint below a folder, sorted."""
    if path.is_file():
        return [(path, path.name)]  # a file named explicitly is taken whatever its suffix
    if not path.is_dir():
        raise InvalidInputError(f"no such file or directory: {path}")
    if not recursive:
        raise InvalidInputError(f"{path} is a directory; use --recursive to import every checkpoint in it")
    found = []
    skip = exclude.resolve() if exclude is not None else None
    for dirpath, dirnames, filenames in os.walk(path):
        here = Path(dirpath)
        # The repository may live inside the folder being imported; never descend into it.
        dirnames[:] = sorted(d for d in dirnames if skip is None or (here / d).resolve() != skip)
        for name in sorted(filenames):
            full = here / name
            if full.suffix.lower() in SUFFIXES and full.is_file():
                found.append((full, full.relative_to(path).as_posix()))
    if not found:
        raise InvalidInputError(f"no {'/'.join(SUFFIXES)} files under {path}")
    return found


def offending_global(message: str) -> str | None:
    """The global named in a torch weights_only refusal, if the message names one."""
    m = _GLOBAL.search(message)
    return m.group(1).rstrip(".") if m else None


@dataclass
class GlobalRef:
    """A global a pickle names: by GLOBAL/INST (text), STACK_GLOBAL (two strings on the stack) or
    EXT1/2/4 (a copyreg extension code, named as such), and the opcode that calls or instantiates
    it, if any."""

    name: str
    opcode: str
    pos: int
    use: str | None = None
    use_pos: int = -1

    def describe(self) -> str:
        return f"{self.name} ({self.opcode}{f' then {self.use}' if self.use and self.use != self.opcode else ''})"


_MARK = object()
# A crafted length field would make pickletools allocate it up front (2**60 bytes: MemoryError);
# no honest argument of a checkpoint's pickle comes near these.
_MAX_ARG = 256 << 20
_MAX_LINE = 1 << 20
_OPCODES = {op.code: op for op in pickletools.opcodes}
_STRINGS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}


def _pop_to_mark(stack: list[Any]) -> list[Any]:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            items = stack[i + 1 :]
            del stack[i:]
            return items
    items = stack[:]
    stack.clear()
    return items


def _use(value: Any, opcode: str, pos: int) -> None:
    if isinstance(value, GlobalRef) and value.use is None:
        value.use, value.use_pos = opcode, pos


class _Bounded:
    """The read side of a stream for pickletools, never asking for more than remains or than
    _MAX_ARG/_MAX_LINE: a short read makes pickletools stop with ValueError."""

    def __init__(self, stream: IO[bytes], size: int) -> None:
        self._stream, self._end = stream, size

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._end - self._stream.tell())
        return self._stream.read(min(left, _MAX_ARG) if n < 0 else min(n, left, _MAX_ARG))

    def readline(self) -> bytes:
        return self._stream.readline(min(max(0, self._end - self._stream.tell()), _MAX_LINE))

    def tell(self) -> int:
        return self._stream.tell()


def _scan_one(stream: _Bounded, found: list[GlobalRef], first_op: dict[int, tuple[str, int]]) -> None:
    """Follow one pickle's opcodes with a stack of placeholders, never building an object:
    strings and global references are tracked (through the memo too), everything else is None."""
    stack: list[Any] = []
    memo: dict[Any, Any] = {}
    # genops reads through read/readline/tell only, which the bounded view provides.
    for op, arg, pos in pickletools.genops(cast(IO[bytes], stream)):
        name = op.name
        first_op.setdefault(ord(op.code), (name, pos or 0))
        top = stack[-1] if stack else None
        if name in ("GLOBAL", "INST"):
            module, _, qualname = str(arg).partition(" ")
            ref = GlobalRef(f"{module}.{qualname}", name, pos or 0)
            found.append(ref)
            if name == "INST":
                _use(ref, name, pos or 0)
                _pop_to_mark(stack)
            stack.append(ref if name == "GLOBAL" else None)
        elif name == "STACK_GLOBAL":
            top_name, top_module = (stack.pop() if stack else None), (stack.pop() if stack else None)
            named = isinstance(top_module, str) and isinstance(top_name, str)
            found.append(ref := GlobalRef(f"{top_module}.{top_name}" if named else "<a computed name>", name, pos or 0))
            stack.append(ref)
        elif name in ("EXT1", "EXT2", "EXT4"):
            # The global is whatever the unpickling process registered under the code (copyreg's
            # extension registry); the writer's intent is unknowable here, so the code is named.
            found.append(ref := GlobalRef(f"with copyreg extension code {arg}", name, pos or 0))
            stack.append(ref)
        elif name in _STRINGS:
            stack.append(arg)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = top
        elif name == "MEMOIZE":
            memo[len(memo)] = top
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg))
        elif name == "DUP":
            stack.append(top)
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            depth = 3 if name == "NEWOBJ_EX" else 2
            _use(stack[-depth] if len(stack) >= depth else None, name, pos or 0)
            del stack[-depth:]
            stack.append(None)
        elif name == "OBJ":
            items = _pop_to_mark(stack)
            _use(items[0] if items else None, name, pos or 0)
            stack.append(None)
        else:
            before = op.stack_before
            if pickletools.markobject in before:
                _pop_to_mark(stack)
                before = before[: before.index(pickletools.markobject)]
            del stack[len(stack) - min(len(before), len(stack)) :]
            stack.extend(_MARK if item is pickletools.markobject else None for item in op.stack_after)


def scan_globals(path: Path, is_zip: bool) -> tuple[list[GlobalRef], dict[int, tuple[str, int]]]:
    """Every global the checkpoint's pickles name, in order, and the name and position of the
    first opcode of each code, by a static reading of the opcodes (pickletools): nothing is
    unpickled. A damaged pickle ends the scan; what was found before stands."""
    found: list[GlobalRef] = []
    first_op: dict[int, tuple[str, int]] = {}
    try:
        if is_zip:
            with zipfile.ZipFile(path) as zf:
                # torch.save writes <archive>/data.pkl; torch reads the first one.
                names = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
                if names:
                    with zf.open(names[0]) as stream:
                        _scan_one(_Bounded(stream, zf.getinfo(names[0]).file_size), found, first_op)
        else:
            with open(path, "rb") as stream:
                bounded = _Bounded(stream, os.fstat(stream.fileno()).st_size)
                for _ in range(_LEGACY_PICKLES):
                    _scan_one(bounded, found, first_op)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, KeyError, IndexError, MemoryError):
        pass  # a pickle torch could not read either: report what was seen
    return found, first_op


def _allowed_globals(torch: Any) -> set[str]:
    """The globals torch's weights_only loader accepts ("module.name"); a private torch table, so
    an empty set (every global is reported) if a later torch moves it."""
    try:
        unpickler = torch._weights_only_unpickler
        return set(unpickler._get_allowed_globals()) | set(unpickler._get_user_allowed_globals())
    except (AttributeError, TypeError):
        return set()


def _refusal(torch: Any, path: Path, is_zip: bool, text: str) -> UnsafeCheckpointError:
    """The error for a pickle torch's weights_only loader refused, naming the global behind it.

    torch names a global only for GLOBAL; it stops at the first opcode it lacks (STACK_GLOBAL,
    INST, OBJ, NEWOBJ_EX, EXT1/2/4, or even FRAME or SHORT_BINUNICODE before them), so the
    pickle's opcodes are read statically to find a global torch does not allow.
    """
    name = offending_global(text)
    refs, first_op = scan_globals(path, is_zip) if name is None else ([], {})
    allowed = _allowed_globals(torch) if name is None else set()
    for ref in refs:
        if ref.name not in allowed:
            name = ref.describe()
            break
    if name is not None:
        return UnsafeCheckpointError(
            f"{path} refused: it needs the global {name}, which torch's weights_only loader does not"
            " allow (loading it could run arbitrary code); if you trust the file, load it yourself"
            " (torch.load(..., weights_only=False)), keep the tensors and plain values, and commit"
            " them with Repo.commit_state"
        )
    operand = _OPERAND.search(text)
    if operand is not None and int(operand.group(1)) in first_op:
        # Where torch stopped: the first opcode with that code (its reading is sequential too).
        opcode, pos = first_op[int(operand.group(1))]
        for ref in refs:  # an allowed global, through an opcode torch does not implement
            if pos in (ref.pos, ref.use_pos):
                return UnsafeCheckpointError(
                    f"{path} refused: it names the global {ref.describe()} through the pickle opcode"
                    f" {opcode}, which torch's weights_only loader does not support"
                )
        proto = _OPCODES[chr(int(operand.group(1)))].proto
        return UnsafeCheckpointError(
            f"{path} cannot be loaded safely with weights_only: pickle opcode {opcode} ({operand.group(1)})"
            " is not supported by torch's weights_only loader"
            + (f" (it belongs to pickle protocol {proto}; torch.save's default protocol 2 loads)" if proto > 2 else "")
        )
    return UnsafeCheckpointError(f"{path} cannot be loaded safely with weights_only: {_reason(text)}")


def load_checkpoint(path: Path) -> Any:
    """``torch.load`` restricted to weights (never full unpickling), memory-mapped when possible."""
    torch = _torch()
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    is_zip = magic == _ZIP_MAGIC
    if not is_zip and not magic.startswith(_PICKLE_PROTO) and Path(path).suffix != ".safetensors":
        # torch.save writes a zip, or (the legacy format) a pickle of protocol 2 or later, which
        # starts with the PROTO opcode: anything else is not a checkpoint, whatever torch says.
        # (A .safetensors file goes on to torch, which hands it to safetensors.)
        raise InvalidInputError(f"{path} is not a PyTorch checkpoint (neither a zip nor a pickle file)")
    import pickle
    import warnings

    from safetensors import SafetensorError

    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols and the like on stderr; the CLI's contract is
            # one line per outcome, and a refusal is reported as an error below anyway.
            warnings.simplefilter("ignore")
            # mmap only works for the zip format; deciding up front (as torch does) instead of
            # retrying on an error keeps a single, restricted load per file.
            return torch.load(path, weights_only=True, mmap=is_zip, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise _refusal(torch, path, is_zip, str(exc)) from None
    except SafetensorError as exc:  # torch hands a .safetensors file to safetensors
        raise SafetensorsFormatError(f"{path} is not a valid safetensors file: {exc}") from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError, TypeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise InvalidInputError(f"{path} is not a readable PyTorch checkpoint: {first}") from None


def _reason(text: str) -> str:
    """The unpickler's own complaint out of torch's long advice text."""
    _, marker, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if marker else text).splitlines() if line.strip()]
    return lines[0] if lines else "unknown reason"


def import_checkpoints(
    commit_state: Callable[..., str],
    load_state: Callable[[str], Any],
    path: str | os.PathLike[str],
    *,
    exclude: Path | None = None,
    recursive: bool = False,
    message: str | None = None,
    branch: str | None = None,
    delete_source: bool = False,
    metadata: Mapping[str, Any] | None = None,
) -> Iterator[ImportResult]:
    """Commit each checkpoint at ``path`` (one commit per file, in path order) and yield results.

    ``commit_state`` and ``load_state`` are the repository's (``Repo.commit_state`` /
    ``Repo.load_state``); ``exclude`` is the repository folder, never searched for checkpoints.
    Stops at the first file that fails; the commits yielded before it stand (each is complete).
    """
    _torch()  # refuse an old or missing torch before anything is read
    for source, name in find_checkpoints(Path(path), recursive, exclude):
        state = load_checkpoint(source)
        meta = {**(metadata or {}), "source": str(source.resolve())}
        oid = commit_state(state, message=name if message is None else message, branch=branch, metadata=meta)
        deleted = False
        if delete_source:
            verify_commit(load_state, oid, state, source)
            del state  # drop the memory map before the file goes
            try:
                source.unlink()
            except OSError as exc:
                raise InvalidInputError(f"committed {oid[:12]} but cannot delete {source}: {exc.strerror}") from None
            deleted = True
        yield ImportResult(source, oid, deleted)


def verify_commit(load_state: Callable[[str], Any], oid: str, original: Any, source: Path) -> None:
    """Read the commit back (every chunk re-hashed) and require it to equal ``original`` exactly."""
    restored = load_state(oid)
    problem = _difference(original, restored, "")
    if problem is not None:
        raise IntegrityError(f"commit {oid[:12]} does not reproduce {source} ({problem}); source kept")


def _difference(a: Any, b: Any, where: str) -> str | None:
    """Where ``a`` and ``b`` first differ (bit-exact for tensors and floats), or None."""
    import torch

    at = where or "<root>"
    if isinstance(a, torch.Tensor):
        # Parameters come back as plain tensors: the encoding keeps data, not the wrapper class.
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return f"tensor at {at} differs in type, dtype or shape"
        x, y = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        return None if torch.equal(x, y) else f"tensor at {at} differs"
    if type(a) is not type(b):
        return f"value at {at} is {type(b).__name__}, expected {type(a).__name__}"
    if isinstance(a, float):
        # Bit-exact: the encoding keeps -0.0 and NaN payloads, so they must survive.
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"value at {at} differs"
    if isinstance(a, np.ndarray):
        same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        return None if same else f"array at {at} differs"
    if isinstance(a, Mapping):
        if list(a) != list(b):
            return f"keys at {at} differ"
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return f"state_dict metadata at {at} differs"
        for key in a:
            problem = _difference(a[key], b[key], f"{where}.{key}" if where else str(key))
            if problem:
                return problem
        return None
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        if len(a) != len(b):
            return f"length at {at} differs"
        for i, (x, y) in enumerate(zip(a, b)):
            problem = _difference(x, y, f"{where}.{i}" if where else str(i))
            if problem:
                return problem
        return None
    return None if a == b else f"value at {at} differs"

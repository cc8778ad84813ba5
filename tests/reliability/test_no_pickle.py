"""No pickle: ckstore's source never unpickles, directly or through torch/numpy loaders.

An AST scan of every module under ckstore/ fails on: importing from pickle, cPickle, _pickle,
dill, cloudpickle, joblib or shelve; any use of those modules other than naming their exception
classes (legacy.py catches ``pickle.UnpicklingError`` from torch's restricted loader); ``torch.load`` without ``weights_only=True``; ``np.load``/``numpy.load`` without
``allow_pickle=False``; ``allow_pickle=True`` anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .helpers import count

ROOT = Path(__file__).resolve().parents[2] / "ckstore"
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "copyreg"}
HARMLESS = {"UnpicklingError", "PickleError", "PicklingError"}  # exception classes, for except clauses


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def violations(source: str, filename: str) -> list[str]:
    found = []
    tree = ast.parse(source, filename)
    # ``pickle.UnpicklingError`` and friends only name exceptions: the one harmless use.
    harmless = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.attr in HARMLESS
    }
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in PICKLERS and (top != "pickle" or a.asname or not harmless):
                    found.append(f"{where}: import {a.name}")
        elif isinstance(node, ast.Name) and node.id in PICKLERS and id(node) not in harmless:
            found.append(f"{where}: use of {node.id}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLERS:
                found.append(f"{where}: from {node.module} import …")
            found += [f"{where}: import of {a.name}" for a in node.names if a.name in ("Unpickler", "load_pickle")]
        elif isinstance(node, ast.Attribute) and node.attr in ("Unpickler", "_Unpickler"):
            found.append(f"{where}: {_dotted(node)}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            head, _, tail = name.rpartition(".")
            if head.split(".")[-1] in PICKLERS and tail in ("load", "loads", "Unpickler"):
                found.append(f"{where}: {name}()")
            if name == "torch.load" and not _is_const(_keyword(node, "weights_only"), True):
                found.append(f"{where}: torch.load without weights_only=True")
            if name in ("np.load", "numpy.load") and not _is_const(_keyword(node, "allow_pickle"), False):
                found.append(f"{where}: {name} without allow_pickle=False")
            if _is_const(_keyword(node, "allow_pickle"), True) or (
                _keyword(node, "allow_pickle") is not None
                and not isinstance(_keyword(node, "allow_pickle"), ast.Constant)
            ):
                found.append(f"{where}: allow_pickle not literally False")
    return found


def test_ckstore_sources_never_unpickle() -> None:
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 10
    problems = [v for f in files for v in violations(f.read_text(), str(f.relative_to(ROOT.parent)))]
    count("no_pickle_files_scanned", len(files))
    assert problems == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import cPickle as p",
        "from pickle import loads",
        "import dill",
        "import cloudpickle",
        "from _pickle import Unpickler",
        "x = pickle.Unpickler(f)",
        "torch.load(f)",
        "torch.load(f, weights_only=False)",
        "np.load(f)",
        "numpy.load(f, allow_pickle=True)",
        "np.load(f, allow_pickle=flag)",
        "joblib.load(f)",
        "import pickle\npickle.loads(b)",
        "import pickle\nu = pickle",
        "import pickle as p",
    ],
)
def test_scanner_catches(snippet: str) -> None:
    assert violations(snippet, "<snippet>")


@pytest.mark.parametrize(
    "snippet",
    [
        "torch.load(f, weights_only=True)",
        "np.load(f, allow_pickle=False)",
        "json.loads(s)",
        "x.load(f)",
        "import pickle\ntry:\n    pass\nexcept pickle.UnpicklingError:\n    pass",
    ],
)
def test_scanner_allows(snippet: str) -> None:
    assert not violations(snippet, "<snippet>")

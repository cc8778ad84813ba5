"""A training state's structure in words for ``show`` (not the typed-JSON encoding of values.py).

``{"$odict": [["weight", {"$tensor": {"name": "model.weight"}}], ...]}`` becomes
``2 tensors, F32, 40 B: weight [2, 4], bias [2]``. Pure: the caller passes the state's tensors.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

from ckstore.format.manifest import TensorEntry
from ckstore.runtime.units import human

WIDTH = 110  # characters per top-level line before "…"


def _pairs(value: Any) -> list[tuple[Any, Any]] | None:
    """The entries of a mapping in any of its encodings, or None for a non-mapping."""
    if isinstance(value, dict):
        if "$odict" in value:
            return [tuple(p) for p in value["$odict"]]
        if "$dict" in value:
            return [tuple(p) for p in value["$dict"]]
        if not any(k.startswith("$") for k in value):
            return list(value.items())
    return None


def _key(key: Any) -> str:
    return describe(key, {}) if isinstance(key, dict) else str(key)


def _tensors_in(value: Any) -> Iterator[str]:
    """The names of the tensors anywhere inside ``value``; stops (yielding "") at a non-tensor leaf."""
    if isinstance(value, dict) and "$tensor" in value:
        yield value["$tensor"].get("name", "")
        return
    pairs = _pairs(value)
    items = [v for _, v in pairs] if pairs is not None else value if isinstance(value, list) else None
    if items is None or not items:
        yield ""
        return
    for item in items:
        yield from _tensors_in(item)


def _shape(t: TensorEntry | None) -> str:
    return f"[{', '.join(map(str, t.shape))}]" if t is not None else "?"


def describe(value: Any, tensors: Mapping[str, TensorEntry]) -> str:
    """One value of a state, in words; nested containers are summarised, not spelled out."""
    if isinstance(value, dict) and len(value) == 1 or isinstance(value, dict) and "$odict" in value:
        tag = next(iter(value))
        payload = value[tag]
        if tag == "$tensor":
            t = tensors.get(payload.get("name", ""))
            return f"tensor {t.dtype} {_shape(t)}" if t is not None else "tensor"
        if tag == "$int":
            return payload
        if tag == "$f64":
            return repr(struct.unpack("<d", bytes.fromhex(payload))[0])
        if tag == "$bytes":
            return f"{len(payload) * 3 // 4 - payload[-2:].count('=')} bytes"  # base64, padded
        if tag == "$npscalar":
            return f"numpy {payload.get('dtype', '')} scalar"
        if tag == "$tuple":
            return "(" + ", ".join(describe(v, tensors) for v in payload) + ")"
    pairs = _pairs(value)
    if pairs is not None:
        names = list(_tensors_in(value))
        if pairs and "" not in names:  # tensors only: count them, list the first few
            found = [tensors[n] for n in names if n in tensors]
            dtypes = ", ".join(f"{d} ×{n}" if n > 1 else d for d, n in Counter(t.dtype for t in found).items())
            head = (
                f"{len(names)} tensor{'s' if len(names) != 1 else ''} ({dtypes}, {human(sum(t.nbytes for t in found))})"
            )
            if len(pairs) <= 4 and all(isinstance(v, dict) and "$tensor" in v for _, v in pairs):
                head += ": " + ", ".join(
                    f"{_key(k)} {_shape(tensors.get(v['$tensor'].get('name', '')))}" for k, v in pairs
                )
            return head
        if len(pairs) > 8:
            return f"{len(pairs)} entries: " + ", ".join(_key(k) for k, _ in pairs[:8]) + ", …"
        return "{" + ", ".join(f"{_key(k)}: {describe(v, tensors)}" for k, v in pairs) + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        first = describe(value[0], tensors)
        return f"[{first}]" if len(value) == 1 else f"list of {len(value)}, the first {first}"
    return repr(value) if isinstance(value, str) else str(value)


def state_lines(value: Any, tensors: Mapping[str, TensorEntry]) -> list[str]:
    """One line per top-level entry of a training state, each at most WIDTH characters."""
    pairs = _pairs(value)
    if pairs is None:
        return [_cut(describe(value, tensors))]
    return [_cut(f"{_key(k)}: {describe(v, tensors)}") for k, v in pairs]


def _cut(text: str) -> str:
    return text if len(text) <= WIDTH else text[: WIDTH - 1] + "…"

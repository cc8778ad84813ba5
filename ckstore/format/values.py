"""Exact, pickle-free encoding of nested Python values as JSON-compatible data.

Used for commit metadata and the non-tensor part of training state (optimizer param_groups,
scheduler state, counters, RNG states, ``_extra_state``) inside JSON manifests. Normative rules:

Scalars (the type must be exactly the one named; subclasses such as IntEnum are not scalars):
  None, bool, str        -> themselves; str must be valid Unicode (no lone surrogates), so the
                            JSON can be written as UTF-8.
  int                    -> a JSON integer when -2**53 <= x <= 2**53 (exact in every JSON
                            reader); otherwise {"$int": "<canonical decimal>"}, at most 4300
                            digits (Python's default int/str conversion limit).
  float                  -> a JSON number when finite (repr() round-trips, -0.0 included);
                            nan/inf/-inf -> {"$f64": "<16 lowercase hex digits>"}, the bytes of
                            struct.pack("<d", x), so sign and NaN payload survive.
  bytes                  -> {"$bytes": "<standard base64, padded>"}.
  numpy scalar (kind bool/int/uint/float/complex)
                         -> {"$npscalar": {"dtype": "<dtype.name, e.g. float32>",
                                           "hex": "<lowercase hex of its little-endian bytes>"}}.
Containers:
  list                   -> JSON array.
  tuple                  -> {"$tuple": [items]}.
  dict whose keys are all str and none starts with "$"
                         -> JSON object, key order preserved.
  any other dict         -> {"$dict": [[key, value], ...]}, keys encoded by these same rules.
  collections.OrderedDict-> {"$odict": [[key, value], ...]}, plus "meta": <encoded value> when
                            the object has a ``_metadata`` attribute (torch state_dict() sets it).
Leaves: any other value is offered to the ``leaf`` callback as ``leaf(path, value)``; it returns
  NotImplemented or ``(tag, payload)`` with payload plain JSON (finite floats, str keys) and tag
  matching [A-Za-z][A-Za-z0-9_.-]{0,63} and not reserved (tuple dict odict int f64 bytes
  npscalar); the result is {"$<tag>": payload}. Decoding hands unknown tags to ``leaf(tag,
  payload)``.

A JSON object with a key starting with "$" is a tag object: exactly one such key, and no other
key except "meta" beside "$odict". Plain objects never have "$" keys, so tags are unambiguous.
Containers nest at most MAX_DEPTH (100) levels: tags make the JSON up to 3x deeper than the value
and Python's json module recurses on the C stack. Shared references are stored as copies; cycles,
other types (set, bytearray, functions, objects, container subclasses) and leaves answering
NotImplemented raise UnencodableValueError naming the key path.

The encoding is canonical: each value has exactly one encoding, and decode_value accepts exactly
the encodings (non-canonical input such as a plain 2**60 or {"$int": "5"} is rejected), so
encode_value(decode_value(x)) == x for every x decode_value accepts. decode_value raises only
IntegrityError for bad input (plus any CkstoreError a leaf decoder raises on purpose).
"""

from __future__ import annotations

import base64
import binascii
import collections
import math
import re
import struct
from collections.abc import Callable
from types import NotImplementedType
from typing import Any, TypeAlias, cast

from ckstore.errors import CkstoreError, IntegrityError, UnencodableValueError

JSONValue: TypeAlias = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]
KeyPath: TypeAlias = tuple[str | int, ...]
LeafEncoder: TypeAlias = Callable[[KeyPath, object], "tuple[str, JSONValue] | NotImplementedType"]
LeafDecoder: TypeAlias = Callable[[str, JSONValue], object]

MAX_DEPTH = 100
MAX_INT_DIGITS = 4300
RESERVED_TAGS = frozenset({"tuple", "dict", "odict", "int", "f64", "bytes", "npscalar"})

_SAFE_INT = 2**53  # the largest magnitude every IEEE-double JSON reader keeps exact
_TAG_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}\Z")
_INT_RE = re.compile(r"-?[1-9][0-9]*\Z")
_HEX16_RE = re.compile(r"[0-9a-f]{16}\Z")
_HEX_RE = re.compile(r"(?:[0-9a-f]{2}){1,64}\Z")
_NP_KINDS = "biufc"  # bool, int, uint, float, complex: fixed-size raw bytes, nothing else
_ODict = collections.OrderedDict


def format_path(path: KeyPath) -> str:
    """Render a key path for messages: ("opt", "state", 0) -> "opt.state.0"; () -> "<root>"."""
    if not path:
        return "<root>"
    # Quote keys that would otherwise read as several path elements (or none).
    return ".".join(repr(p) if isinstance(p, str) and (not p or "." in p) else str(p) for p in path)


def _label(key: object) -> str | int:
    """A path element for a dict key; non-str/int keys are shown by a short repr."""
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    try:
        text = repr(key)
    except Exception:  # a leaf-decoded key may have a broken __repr__; messages must not fail
        text = f"<{type(key).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _np_hex(np: Any, v: Any) -> str:
    # Force little-endian so the bytes do not depend on the writing machine.
    return str(np.asarray(v).astype(v.dtype.newbyteorder("<")).tobytes().hex())


def encode_value(value: object, *, leaf: LeafEncoder | None = None) -> JSONValue:
    """Encode ``value`` as canonical JSON-compatible data (rules in the module docstring)."""
    return _Encoder(leaf).encode(value, (), 0)


def decode_value(data: JSONValue, *, leaf: LeafDecoder | None = None) -> object:
    """Invert encode_value; malformed or non-canonical ``data`` raises IntegrityError."""
    return _Decoder(leaf).decode(data, (), 0)


class _Encoder:
    def __init__(self, leaf: LeafEncoder | None) -> None:
        self.leaf = leaf
        self.active: set[int] = set()  # ids of containers on the current path: cycle detection

    def encode(self, v: Any, path: KeyPath, depth: int) -> JSONValue:
        t = type(v)
        if v is None or t is bool:
            return cast(JSONValue, v)
        if t is str:
            if not _unicode_ok(v):
                raise UnencodableValueError(f"string at {format_path(path)} holds a lone surrogate")
            return cast(str, v)
        if t is int:
            return v if -_SAFE_INT <= v <= _SAFE_INT else {"$int": self._digits(v, path)}
        if t is float:
            return v if math.isfinite(v) else {"$f64": struct.pack("<d", v).hex()}
        if t is bytes:
            return {"$bytes": base64.b64encode(v).decode("ascii")}
        if t is list or t is tuple or t is dict or t is _ODict:
            return self._container(v, path, depth)
        if t.__module__ == "numpy":
            import numpy as np  # lazily: only numpy's own objects get here

            if isinstance(v, np.generic) and v.dtype.kind in _NP_KINDS:
                return {"$npscalar": {"dtype": v.dtype.name, "hex": _np_hex(np, v)}}
        return self._leaf(v, path)

    def _digits(self, v: int, path: KeyPath) -> str:
        try:
            text = str(v)
        except ValueError:  # interpreter's int-to-str limit (sys.set_int_max_str_digits)
            text = ""
        if not text or len(text.lstrip("-")) > MAX_INT_DIGITS:
            raise UnencodableValueError(f"integer at {format_path(path)} has more than {MAX_INT_DIGITS} digits")
        return text

    def _container(self, v: Any, path: KeyPath, depth: int) -> JSONValue:
        where = format_path(path)
        if id(v) in self.active:
            raise UnencodableValueError(f"reference cycle at {where}: {type(v)!r} contains itself")
        if depth >= MAX_DEPTH:
            raise UnencodableValueError(f"value nested deeper than {MAX_DEPTH} levels at {where}")
        self.active.add(id(v))
        try:
            t, d = type(v), depth + 1
            if t is list or t is tuple:
                items = [self.encode(x, path + (i,), d) for i, x in enumerate(v)]
                return items if t is list else {"$tuple": items}
            if t is dict and all(type(k) is str and not k.startswith("$") for k in v):
                for k in v:
                    if not _unicode_ok(k):
                        raise UnencodableValueError(f"key at {format_path(path)} holds a lone surrogate")
                return {k: self.encode(x, path + (k,), d) for k, x in v.items()}
            pairs: list[JSONValue] = [
                [self.encode(k, path + (_label(k),), d), self.encode(x, path + (_label(k),), d)] for k, x in v.items()
            ]
            if t is dict:
                return {"$dict": pairs}
            out: dict[str, JSONValue] = {"$odict": pairs}
            attrs = vars(v)  # OrderedDict instances carry a __dict__; only _metadata is known
            if set(attrs) - {"_metadata"}:
                extra = sorted(set(attrs) - {"_metadata"})
                raise UnencodableValueError(f"OrderedDict at {where} has attributes {extra}")
            if "_metadata" in attrs:
                out["meta"] = self.encode(attrs["_metadata"], path + ("_metadata",), d)
            return out
        finally:
            self.active.discard(id(v))

    def _leaf(self, v: object, path: KeyPath) -> JSONValue:
        res = NotImplemented if self.leaf is None else self.leaf(path, v)
        if res is NotImplemented:
            raise UnencodableValueError(f"cannot store {type(v)!r} at {format_path(path)} without pickle")
        # A malformed answer is a bug in the caller's callback, not bad user input: ValueError.
        if not (type(res) is tuple and len(res) == 2 and type(res[0]) is str and _TAG_RE.match(res[0])):
            raise ValueError(f"leaf encoder must return NotImplemented or (tag, payload), got {res!r:.80}")
        tag, payload = res
        if tag in RESERVED_TAGS:
            raise ValueError(f"leaf encoder may not use reserved tag {tag!r}")
        _check_payload(payload, 0)
        return {"$" + tag: payload}


def _unicode_ok(s: str) -> bool:
    # Lone surrogates (e.g. from surrogateescape) cannot be written as UTF-8 JSON.
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_payload(p: Any, depth: int) -> None:
    """Reject leaf payloads that would not survive json.dumps(allow_nan=False) exactly."""
    t = type(p)
    if p is None or t is bool or t is int or (t is float and math.isfinite(p)):
        return
    if t is str and _unicode_ok(p):
        return
    if depth >= MAX_DEPTH or (t is not list and t is not dict):
        raise ValueError(f"leaf payload is not plain JSON (or nested too deep): {type(p)!r}")
    if t is dict and not all(type(k) is str and _unicode_ok(k) for k in p):
        raise ValueError("leaf payload has a non-str object key")
    for x in p.values() if t is dict else p:
        _check_payload(x, depth + 1)


class _Decoder:
    def __init__(self, leaf: LeafDecoder | None) -> None:
        self.leaf = leaf

    def decode(self, d: Any, path: KeyPath, depth: int) -> object:
        t = type(d)
        if d is None or t is bool:
            return d
        if t is str:
            if _unicode_ok(d):
                return d
            raise _bad(path, "string holds a lone surrogate")
        if t is int:
            if -_SAFE_INT <= d <= _SAFE_INT:
                return d
            raise _bad(path, "integer beyond 2**53 must be written as $int")
        if t is float:
            if math.isfinite(d):
                return d
            raise _bad(path, "non-finite float must be written as $f64")
        if t is list:
            self._enter(path, depth)
            return [self.decode(x, path + (i,), depth + 1) for i, x in enumerate(d)]
        if t is not dict:
            raise _bad(path, f"{t.__name__} is not a JSON type")
        keys = list(d)
        if not all(type(k) is str and _unicode_ok(k) for k in keys):
            raise _bad(path, "object key is not a valid string")
        tags = [k for k in keys if k.startswith("$")]
        if not tags:
            self._enter(path, depth)
            return {k: self.decode(x, path + (k,), depth + 1) for k, x in d.items()}
        key = tags[0]
        if len(tags) > 1 or set(keys) - ({key, "meta"} if key == "$odict" else {key}):
            raise _bad(path, f"tag object {key} has extra keys")
        return self._tag(key[1:], d, path, depth)

    def _enter(self, path: KeyPath, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise _bad(path, f"nested deeper than {MAX_DEPTH} levels")

    def _tag(self, tag: str, d: dict[str, Any], path: KeyPath, depth: int) -> object:
        p = d["$" + tag]
        if tag == "tuple":
            if type(p) is not list:
                raise _bad(path, "$tuple payload is not a list")
            self._enter(path, depth)
            return tuple(self.decode(x, path + (i,), depth + 1) for i, x in enumerate(p))
        if tag == "dict" or tag == "odict":
            return self._mapping(tag, d, path, depth)
        if tag == "int":
            if type(p) is not str or not _INT_RE.match(p) or len(p.lstrip("-")) > MAX_INT_DIGITS:
                raise _bad(path, "$int payload is not canonical decimal digits")
            try:
                v = int(p)
            except ValueError:  # interpreter's int/str digit limit set lower than ours
                raise _bad(path, "$int too long for this interpreter") from None
            if -_SAFE_INT <= v <= _SAFE_INT:
                raise _bad(path, "$int used for an integer within 2**53")
            return v
        if tag == "f64":
            if type(p) is not str or not _HEX16_RE.match(p):
                raise _bad(path, "$f64 payload is not 16 lowercase hex digits")
            f: float = struct.unpack("<d", bytes.fromhex(p))[0]
            if math.isfinite(f):
                raise _bad(path, "$f64 used for a finite float")
            return f
        if tag == "bytes":
            try:
                raw = base64.b64decode(p, validate=True) if type(p) is str else None
            except (binascii.Error, ValueError):  # bad alphabet/padding, non-ASCII text
                raw = None
            if raw is None or base64.b64encode(raw).decode("ascii") != p:
                raise _bad(path, "$bytes payload is not canonical base64")
            return raw
        if tag == "npscalar":
            return _decode_npscalar(p, path)
        if not _TAG_RE.match(tag) or tag in RESERVED_TAGS:
            raise _bad(path, f"malformed tag {'$' + tag!r:.70}")
        if self.leaf is None:
            raise _bad(path, f"unknown tag ${tag} and no decoder for it")
        try:
            return self.leaf(tag, p)
        except CkstoreError:
            raise  # the leaf decoder chose its error (e.g. a missing object): keep it
        except Exception as e:
            raise _bad(path, f"${tag} payload rejected: {type(e).__name__}: {e}") from e

    def _mapping(self, tag: str, d: dict[str, Any], path: KeyPath, depth: int) -> object:
        pairs = d["$" + tag]
        if type(pairs) is not list or not all(type(x) is list and len(x) == 2 for x in pairs):
            raise _bad(path, f"${tag} payload is not a list of [key, value] pairs")
        self._enter(path, depth)
        out: Any = {} if tag == "dict" else _ODict()
        for i, (k, x) in enumerate(pairs):
            key = self.decode(k, path + (f"<key {i}>",), depth + 1)
            try:
                hash(key)
            except Exception:
                raise _bad(path, f"${tag} key {i} is unhashable ({type(key).__name__})") from None
            out[key] = self.decode(x, path + (_label(key),), depth + 1)
        if len(out) != len(pairs):
            raise _bad(path, f"${tag} has duplicate keys")
        if tag == "dict" and all(type(k) is str and not k.startswith("$") for k in out):
            raise _bad(path, "$dict used for a dict that is a plain object")
        if "meta" in d:
            out._metadata = self.decode(d["meta"], path + ("_metadata",), depth + 1)
        return out


def _decode_npscalar(p: object, path: KeyPath) -> object:
    if (
        type(p) is not dict
        or set(p) != {"dtype", "hex"}
        or type(p["dtype"]) is not str
        or type(p["hex"]) is not str
        or not _HEX_RE.match(p["hex"])
    ):
        raise _bad(path, "$npscalar payload is not {dtype: str, hex: lowercase hex}")
    try:
        import numpy as np  # lazily: only manifests holding numpy scalars need it

        dt = np.dtype(p["dtype"])
        ok = dt.kind in _NP_KINDS and dt.name == p["dtype"] and dt.itemsize * 2 == len(p["hex"])
        v = np.frombuffer(bytes.fromhex(p["hex"]), dtype=dt.newbyteorder("<"))[0] if ok else None
        # Re-encoding must give the same text: rejects e.g. a bool stored as byte 0x02.
        ok = ok and type(v) is dt.type and _np_hex(np, v) == p["hex"]
    except Exception as e:  # ImportError, TypeError from np.dtype("garbage"), ...
        raise _bad(path, f"$npscalar undecodable: {type(e).__name__}") from None
    if not ok:
        raise _bad(path, f"$npscalar is not a canonical {p['dtype']!r:.40} scalar")
    return v


def _bad(path: KeyPath, msg: str) -> IntegrityError:
    return IntegrityError(f"malformed stored value at {format_path(path)}: {msg}")

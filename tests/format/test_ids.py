"""Object names: chunk and commit name spaces, id syntax."""

from __future__ import annotations

import blake3
import pytest

from ckstore.errors import InvalidInputError
from ckstore.format.ids import chunk_id, commit_id, is_id_prefix, is_object_id, parse_object_id


def test_chunk_id_is_blake3_of_raw_bytes() -> None:
    for data in (b"", b"abc", bytes(3 << 20)):  # the last one takes the multithreaded path
        assert chunk_id(data) == blake3.blake3(data).hexdigest()
        assert chunk_id(memoryview(data)) == chunk_id(data)


def test_commit_id_is_type_prefixed() -> None:
    manifest = b'{"ckstore":1}'
    assert commit_id(manifest) == blake3.blake3(b"ckstore commit 13\0" + manifest).hexdigest()
    assert commit_id(manifest) != chunk_id(manifest)
    # The length is part of the prefix, so no manifest can imitate another's prefix.
    assert commit_id(b"") != commit_id(b"\0")


@pytest.mark.parametrize(
    "text, ok",
    [
        ("a" * 64, True),
        ("0123456789abcdef" * 4, True),
        ("A" * 64, False),
        ("a" * 63, False),
        ("a" * 65, False),
        ("g" * 64, False),
        ("", False),
        (" " + "a" * 63, False),
        ("a" * 64 + "\n", False),
    ],
)
def test_is_object_id(text: str, ok: bool) -> None:
    assert is_object_id(text) is ok
    if ok:
        assert parse_object_id(text) == text
    else:
        with pytest.raises(InvalidInputError):
            parse_object_id(text)


def test_parse_object_id_refuses_non_strings() -> None:
    for value in (None, 1, b"a" * 64, ["a" * 64]):
        with pytest.raises(InvalidInputError):
            parse_object_id(value)


@pytest.mark.parametrize(
    "text, ok",
    [
        ("abcdef", True),
        ("abcde", False),
        ("a" * 64, True),
        ("a" * 65, False),
        ("ABCDEF", False),
        ("abcdeg", False),
    ],
)
def test_is_id_prefix(text: str, ok: bool) -> None:
    assert is_id_prefix(text) is ok

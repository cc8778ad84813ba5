"""Ref names: which names are valid (git's rules, git's own test vectors, the installed git's
verdict on arbitrary text) and their on-disk encoding (docs/format.md, "Ref names")."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckstore.backend.base import check_key
from ckstore.errors import (
    InvalidRefNameError,
)
from ckstore.repository.refs import (
    check_ref_name,
    decode_ref,
    encode_ref,
    ref_candidates,
    refname_problem,
)


@pytest.mark.parametrize(
    "name",
    [
        "main",
        "feature/x",
        "v1.0",
        "release-2024_05",
        "a/b/c",
        "user@host",
        "x+y",
        "a.b",
        "HEADS",
        "a-",
        "_",
        "lr=3e-4",
        "run#12",
        "exp(1)",
        "ünïcødé",
        "é",
        "50%",
        "a,b;c",
        "a!b",
        "{x}",
        "a]b",
        "'q'",
        '"q"',
        "a&b|c",
        "x" * 250,
        "é" * 41,
        "学习率" * 9,
        "refs",
        "a/refs/b",
        "@x",
        "x@",
        "a{",
        "foo./bar",
        "a.lck",
        "x.lock2",
    ],
)
def test_valid_names(name: str) -> None:
    assert check_ref_name(name) == name


@pytest.mark.parametrize(
    "name, reason",
    [
        ("", "it is empty"),
        ("a..b", "'..'"),
        ("..", "'..'"),
        ("-x", "starts with '-'"),
        (".hidden", "'.hidden' starts with '.'"),
        ("a/.hidden", "'.hidden' starts with '.'"),
        ("x.lock", "ends with '.lock'"),
        ("a/x.lock/b", "'x.lock' ends with '.lock'"),
        ("a//b", "'//'"),
        ("a@{1}", "'@{'"),
        ("@", "'@' alone"),
        ("a\x00b", "U+0000"),
        ("a\x01", "U+0001"),
        ("a\x7f", "U+007F"),
        ("a b", "a space"),
        ("a~1", "'~'"),
        ("a^", "'^'"),
        ("a:b", "':'"),
        ("a?", "'?'"),
        ("a*", "'*'"),
        ("a[0]", "'['"),
        ("a\\b", "'\\'"),
        ("a/", "ends with '/'"),
        ("/a", "starts with '/'"),
        ("a.", "ends with '.'"),
        ("HEAD", "'HEAD' is reserved"),
        ("a\tb", "U+0009"),
        ("a\nb", "U+000A"),
        ("../escape", "'..'"),
        ("refs/../../x", "'..'"),
        ("a\udcff", "not valid Unicode"),
        ("refs/heads/x", "give the short name 'x'"),
        ("refs/tags/v1", "give the short name 'v1'"),
        ("refs/x", "starts with 'refs/'"),
        ("x" * 251, "251 bytes stored"),
        ("é" * 42, "252 bytes stored"),
        ("/".join(["x" * 200] * 3), "602 bytes"),
    ],
)
def test_invalid_names_say_which_rule(name: str, reason: str) -> None:
    with pytest.raises(InvalidRefNameError) as info:
        check_ref_name(name, "branch name")
    message = str(info.value)
    assert message.startswith(f"invalid branch name {name!r}: ") and reason in message, message
    assert "\n" not in message


# ---- git's own test vectors --------------------------------------------------------------------

# Every valid_ref/invalid_ref case of git's t/t1402-check-ref-format.sh (git master, 2026), as
# (refname, options, git accepts it). ckstore checks names as ``git check-ref-format`` does with
# no options or --allow-onelevel. --refspec-pattern only changes how '*' is treated, so its cases
# without '*' are checked too; ckstore has no refspecs (a '*' is always refused) and does not
# normalize (--normalize collapses slashes first), so those cases are listed but not run.
T1402 = [
    ("", "", False),
    ("/", "", False),
    ("/", "--allow-onelevel", False),
    ("/", "--normalize", False),
    ("/", "--allow-onelevel --normalize", False),
    ("foo/bar/baz", "", True),
    ("foo/bar/baz", "--normalize", True),
    ("refs///heads/foo", "", False),
    ("refs///heads/foo", "--normalize", True),
    ("heads/foo/", "", False),
    ("/heads/foo", "", False),
    ("/heads/foo", "--normalize", True),
    ("///heads/foo", "", False),
    ("///heads/foo", "--normalize", True),
    ("./foo", "", False),
    ("./foo/bar", "", False),
    ("foo/./bar", "", False),
    ("foo/bar/.", "", False),
    (".refs/foo", "", False),
    ("refs/heads/foo.", "", False),
    ("heads/foo..bar", "", False),
    ("heads/foo?bar", "", False),
    ("foo./bar", "", True),
    ("heads/foo.lock", "", False),
    ("heads///foo.lock", "", False),
    ("foo.lock/bar", "", False),
    ("foo.lock///bar", "", False),
    ("heads/foo@bar", "", True),
    ("heads/v@{ation", "", False),
    ("heads/foo\\bar", "", False),
    ("heads/foo\t", "", False),
    ("heads/foo\x7f", "", False),
    ("heads/fu\u00df", "", True),
    ("heads/*foo/bar", "--refspec-pattern", True),
    ("heads/foo*/bar", "--refspec-pattern", True),
    ("heads/f*o/bar", "--refspec-pattern", True),
    ("heads/f*o*/bar", "--refspec-pattern", False),
    ("heads/foo*/bar*", "--refspec-pattern", False),
    ("foo", "", False),
    ("foo", "--allow-onelevel", True),
    ("foo", "--refspec-pattern", False),
    ("foo", "--refspec-pattern --allow-onelevel", True),
    ("foo", "--normalize", False),
    ("foo", "--allow-onelevel --normalize", True),
    ("foo/bar", "", True),
    ("foo/bar", "--allow-onelevel", True),
    ("foo/bar", "--refspec-pattern", True),
    ("foo/bar", "--refspec-pattern --allow-onelevel", True),
    ("foo/bar", "--normalize", True),
    ("foo/*", "", False),
    ("foo/*", "--allow-onelevel", False),
    ("foo/*", "--refspec-pattern", True),
    ("foo/*", "--refspec-pattern --allow-onelevel", True),
    ("*/foo", "", False),
    ("*/foo", "--allow-onelevel", False),
    ("*/foo", "--refspec-pattern", True),
    ("*/foo", "--refspec-pattern --allow-onelevel", True),
    ("*/foo", "--normalize", False),
    ("*/foo", "--refspec-pattern --normalize", True),
    ("foo/*/bar", "", False),
    ("foo/*/bar", "--allow-onelevel", False),
    ("foo/*/bar", "--refspec-pattern", True),
    ("foo/*/bar", "--refspec-pattern --allow-onelevel", True),
    ("*", "", False),
    ("*", "--allow-onelevel", False),
    ("*", "--refspec-pattern", False),
    ("*", "--refspec-pattern --allow-onelevel", True),
    ("foo/*/*", "--refspec-pattern", False),
    ("foo/*/*", "--refspec-pattern --allow-onelevel", False),
    ("*/foo/*", "--refspec-pattern", False),
    ("*/foo/*", "--refspec-pattern --allow-onelevel", False),
    ("*/*/foo", "--refspec-pattern", False),
    ("*/*/foo", "--refspec-pattern --allow-onelevel", False),
    ("/foo", "", False),
    ("/foo", "--allow-onelevel", False),
    ("/foo", "--refspec-pattern", False),
    ("/foo", "--refspec-pattern --allow-onelevel", False),
    ("/foo", "--normalize", False),
    ("/foo", "--allow-onelevel --normalize", True),
    ("/foo", "--refspec-pattern --normalize", False),
    ("/foo", "--refspec-pattern --allow-onelevel --normalize", True),
]
T1402_RUN = [
    (name, "--allow-onelevel" in opts, valid)
    for name, opts, valid in T1402
    if "--normalize" not in opts and ("--refspec-pattern" not in opts or "*" not in name)
]


def test_t1402_table_is_complete() -> None:
    assert len(T1402) == 81 and len(T1402_RUN) == 47


@pytest.mark.parametrize("name, onelevel, valid", T1402_RUN, ids=repr)
def test_git_t1402_check_ref_format(name: str, onelevel: bool, valid: bool) -> None:
    assert (refname_problem(name, allow_onelevel=onelevel) is None) is valid


@pytest.mark.parametrize("name", sorted({n for n, _, valid in T1402_RUN if valid}), ids=repr)
def test_every_name_git_accepts_is_a_branch_and_tag_name(name: str) -> None:
    assert check_ref_name(name) == name
    assert ref_candidates(name) == ["refs/heads/" + name, "refs/tags/" + name]


def test_git_refuses_a_branch_named_like_an_option() -> None:
    """t1402 'check-ref-format --branch -nain': git's check_branch_ref refuses a leading '-'."""
    with pytest.raises(InvalidRefNameError, match="starts with '-'"):
        check_ref_name("-nain", "branch name")


# Special characters of git's rules and of the encoding, mixed with arbitrary text.
_TRICKY = st.sampled_from(list("./@{}-~^:?[]\\* \t\x7f%=#()éß\u00a0") + [".lock", "..", "@{", "//", "refs/"])
NAMES = st.lists(st.one_of(_TRICKY, st.characters(blacklist_categories=("Cs",))), max_size=12).map("".join)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command to compare with")
@settings(max_examples=300, deadline=None)
@given(name=NAMES.filter(lambda n: "\x00" not in n))
def test_same_verdict_as_installed_git(name: str) -> None:
    """Differential: refname_problem agrees with the real ``git check-ref-format`` on any text."""
    full = "refs/heads/" + name
    git = subprocess.run(["git", "check-ref-format", full], capture_output=True, check=False)
    assert (refname_problem(full) is None) is (git.returncode == 0), (full, git.stderr)
    if name and not name.startswith("-"):  # git would read a leading '-' as an option
        git = subprocess.run(["git", "check-ref-format", "--allow-onelevel", name], capture_output=True, check=False)
        assert (refname_problem(name, allow_onelevel=True) is None) is (git.returncode == 0), (name, git.stderr)


# ---- the on-disk encoding --------------------------------------------------------------------


@settings(max_examples=500)
@given(name=NAMES)
def test_every_accepted_name_has_a_safe_key_that_decodes_back(name: str) -> None:
    try:
        check_ref_name(name)
    except InvalidRefNameError:
        return
    key = encode_ref("refs/heads/" + name)
    assert key.isascii() and check_key(key) == key and check_key(key + ".lock")
    assert decode_ref(key) == "refs/heads/" + name
    assert len(key.split("/")[-1]) <= 250 and not key.endswith(".lock")


@given(name=st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/@+-", min_size=1))
def test_names_of_the_previous_alphabet_keep_their_keys(name: str) -> None:
    assert encode_ref(name) == name
    if refname_problem("refs/heads/" + name) is None:
        assert decode_ref("refs/heads/" + name) == "refs/heads/" + name  # old repositories read unchanged


@pytest.mark.parametrize(
    "name, key",
    [
        ("lr=3e-4", "lr%3D3e-4"),
        ("run#12", "run%2312"),
        ("exp(1)", "exp%281%29"),
        ("50%", "50%25"),
        ("ünï", "%C3%BCn%C3%AF"),
        ("a=b/c", "a%3Db/c"),
        ("学", "%E5%AD%A6"),
    ],
)
def test_encoding_examples_from_format_md(name: str, key: str) -> None:
    assert encode_ref(name) == key and decode_ref("refs/heads/" + key) == "refs/heads/" + name


@pytest.mark.parametrize(
    "key",
    [
        "refs/heads/%41",  # 'A' escaped: not canonical, would let two keys hold one name
        "refs/heads/%c3%bc",
        "refs/heads/%C3",
        "refs/heads/%FF",
        "refs/heads/a%2",
        "refs/heads/%2E%2E",
        "refs/heads/.DS_Store",
        "refs/heads/x.lock",
        "refs/heads/a%20",
        "refs/heads/%2Fetc",
    ],
)
def test_keys_that_are_not_canonical_encodings_decode_to_nothing(key: str) -> None:
    assert decode_ref(key) is None


@pytest.mark.parametrize(
    "name, expected",
    [
        ("x", ["refs/heads/x", "refs/tags/x"]),
        ("a/b", ["refs/heads/a/b", "refs/tags/a/b"]),
        ("refs/heads/x", ["refs/heads/x"]),
        ("refs/tags/v1", ["refs/tags/v1"]),
        ("refs/heads/refs/heads/x", ["refs/heads/refs/heads/x"]),  # made by an older ckstore: still reachable
        ("refs/heads/lr=3e-4", ["refs/heads/lr=3e-4"]),
    ],
)
def test_ref_candidates(name: str, expected: list[str]) -> None:
    assert ref_candidates(name) == expected


@pytest.mark.parametrize("name", ["a..b", "refs/heads/a..b", "refs/heads/", "refs/", "-x", "a b", "@", "refs/x\udcff"])
def test_ref_candidates_refuse_invalid_names(name: str) -> None:
    with pytest.raises(InvalidRefNameError):
        ref_candidates(name)

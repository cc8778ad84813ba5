"""Remote URLs, and where S3 settings come from (environment, shared AWS files, profiles), checked
by resolving them and, end to end, by reaching the test server with them."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from ckstore.errors import (
    InvalidInputError,
    InvalidPathError,
    MissingDependencyError,
    StorageError,
)
from ckstore.transport import RemoteOptions, open_transport, parse_url
from ckstore.transport.awsconfig import resolve
from ckstore.transport.directory import DirectoryTransport
from ckstore.transport.s3 import S3Transport
from ckstore.transport.testserver import FAST, S3Server


@pytest.mark.parametrize(
    "url, expected",
    [
        ("s3://bucket", ("s3", "bucket", "")),
        ("s3://bucket/", ("s3", "bucket", "")),
        ("s3://bucket/team/ckpts/", ("s3", "bucket", "team/ckpts")),
        ("S3://bucket/x", ("s3", "bucket", "x")),
        ("file:///mnt/share/x", ("dir", "/mnt/share/x", "")),
        ("file://localhost/mnt/a%20b", ("dir", "/mnt/a b", "")),
        ("/mnt/share/ckpts", ("dir", "/mnt/share/ckpts", "")),
    ],
)
def test_parse_url(url: str, expected: tuple[str, str, str]) -> None:
    assert parse_url(url) == expected


def test_relative_folder_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_url("shared/ckpts") == ("dir", str(tmp_path / "shared" / "ckpts"), "")


@pytest.mark.parametrize(
    "url, message",
    [
        ("", "invalid remote URL"),
        ("s3://", "names no bucket"),
        ("s3:///prefix", "names no bucket"),
        ("s3://b/../x", "invalid prefix"),
        ("s3://b/a b", "invalid prefix"),
        ("s3://b/x?versionId=1", "query"),
        ("gs://bucket/x", "unsupported remote URL"),
        ("https://example.com/x", "unsupported remote URL"),
        ("file://otherhost/x", "names another host"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        parse_url(url)


def test_open_transport_kinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    t = open_transport(str(tmp_path))
    assert isinstance(t, DirectoryTransport) and t.url == str(tmp_path)
    assert t.describe("refs/x") == f"{tmp_path}/refs/x"
    s3 = open_transport("s3://bucket/pre/fix", RemoteOptions(endpoint_url="http://127.0.0.1:9"))
    assert isinstance(s3, S3Transport) and s3.url == "s3://bucket/pre/fix"
    assert s3.describe("packs/a") == "s3://bucket/pre/fix/packs/a"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(StorageError, match="remote s3://bucket/pre/fix: no AWS credentials"):
        open_transport("s3://bucket/pre/fix")


def test_missing_obstore_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'ckstore\[remote\]'"):
        open_transport("s3://bucket/x")


# ---- settings resolution ----------------------------------------------------------------------


def files(tmp_path: Path, config: str = "", credentials: str = "") -> dict[str, str]:
    (tmp_path / "config").write_text(config)
    (tmp_path / "credentials").write_text(credentials)
    return {
        "AWS_CONFIG_FILE": str(tmp_path / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "HOME": str(tmp_path),
    }


CONFIG = """
[default]
region = eu-west-1

[profile lab]
region = us-west-2
s3 =
  endpoint_url = http://127.0.0.1:9000

[profile flat]
endpoint_url = http://127.0.0.1:9001
aws_access_key_id = from-config
aws_secret_access_key = secret-config
"""
CREDENTIALS = """
[default]
aws_access_key_id = default-key
aws_secret_access_key = default-secret

[lab]
aws_access_key_id = lab-key
aws_secret_access_key = lab-secret
aws_session_token = lab-token
"""


def test_environment_keys_beat_the_default_profile(tmp_path: Path) -> None:
    env = {
        **files(tmp_path, CONFIG, CREDENTIALS),
        "AWS_ACCESS_KEY_ID": "env-key",
        "AWS_SECRET_ACCESS_KEY": "env-secret",
    }
    s = resolve(env=env)
    assert (s.access_key_id, s.secret_access_key, s.region, s.endpoint) == ("env-key", "env-secret", "eu-west-1", None)
    assert "environment" in s.source


def test_default_profile_from_the_credentials_file(tmp_path: Path) -> None:
    s = resolve(env=files(tmp_path, CONFIG, CREDENTIALS))
    assert (s.access_key_id, s.secret_access_key, s.region) == ("default-key", "default-secret", "eu-west-1")
    assert s.source == "profile 'default'"


def test_named_profile_with_nested_s3_endpoint(tmp_path: Path) -> None:
    env = {**files(tmp_path, CONFIG, CREDENTIALS), "AWS_PROFILE": "lab"}
    s = resolve(env=env)
    assert (s.access_key_id, s.session_token, s.region, s.endpoint) == (
        "lab-key",
        "lab-token",
        "us-west-2",
        "http://127.0.0.1:9000",
    )


def test_explicit_profile_beats_environment_keys_and_options_beat_everything(tmp_path: Path) -> None:
    env = {
        **files(tmp_path, CONFIG, CREDENTIALS),
        "AWS_ACCESS_KEY_ID": "env-key",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_REGION": "ap-south-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:7000",
    }
    s = resolve(profile="flat", env=env)
    assert (s.access_key_id, s.region, s.endpoint) == ("from-config", "ap-south-1", "http://127.0.0.1:7000")
    s = resolve(endpoint_url="http://127.0.0.1:1", region="r1", profile="flat", env=env)
    assert (s.endpoint, s.region) == ("http://127.0.0.1:1", "r1")
    env["AWS_ENDPOINT_URL_S3"] = "http://127.0.0.1:7001"  # the service-specific variable wins
    assert resolve(env=env).endpoint == "http://127.0.0.1:7001"


def test_missing_named_profile(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="AWS profile 'nope' is not in"):
        resolve(profile="nope", env=files(tmp_path, CONFIG, CREDENTIALS))
    with pytest.raises(StorageError, match="AWS profile 'gone' is not in"):
        resolve(env={**files(tmp_path), "AWS_PROFILE": "gone"})


def test_no_credentials_never_reach_for_instance_metadata_when_disabled(tmp_path: Path) -> None:
    env = files(tmp_path)
    with pytest.raises(StorageError, match="no AWS credentials") as excinfo:
        resolve(env=env)
    assert excinfo.value.exit_code == 7
    # As the AWS SDKs do, the last resort is instance metadata (resolve itself sends nothing).
    env["AWS_EC2_METADATA_DISABLED"] = "false"
    assert resolve(env=env).source == "instance metadata"
    assert resolve(env={**env, "AWS_SKIP_SIGNATURE": "true"}).source.startswith("anonymous")
    assert resolve(env={**env, "AWS_WEB_IDENTITY_TOKEN_FILE": "/x"}).access_key_id is None


def test_unreadable_config_file_is_named(tmp_path: Path) -> None:
    env = files(tmp_path, "[default\nregion = x\n")
    with pytest.raises(StorageError, match=f"cannot read AWS settings from {tmp_path / 'config'}"):
        resolve(env=env)


def test_credential_process_profile_goes_to_boto3(tmp_path: Path) -> None:
    config = "[profile proc]\ncredential_process = /bin/true\n"
    s = resolve(env={**files(tmp_path, config), "AWS_PROFILE": "proc"})
    assert s.boto3_profile == "proc" and s.access_key_id is None


# ---- end to end against the server ------------------------------------------------------------


def test_url_and_environment_reach_the_server(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    t = open_transport(f"s3://{s3_server.bucket}/env/{uuid.uuid4().hex}", FAST)
    t.put("k", b"via env")
    assert t.get("k") == b"via env"


def test_profile_files_reach_the_server(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = f"[profile ck]\nregion = us-east-1\ns3 =\n  endpoint_url = {s3_server.endpoint}\n"
    creds = f"[ck]\naws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n"
    for name, value in files(tmp_path, config, creds).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_PROFILE", "ck")
    t = open_transport(f"s3://{s3_server.bucket}/profile/{uuid.uuid4().hex}", FAST)
    assert t.put_if_absent("k", b"via profile") and t.get("k") == b"via profile"


def test_credential_process_reaches_the_server(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "creds.py"
    script.write_text(
        "import json\nprint(json.dumps("
        + repr({"Version": 1, "AccessKeyId": s3_server.access_key, "SecretAccessKey": s3_server.secret_key})
        + "))\n"
    )
    config = f"[profile proc]\ncredential_process = {sys.executable} {script}\nendpoint_url = {s3_server.endpoint}\n"
    for name, value in files(tmp_path, config).items():
        monkeypatch.setenv(name, value)
    t = open_transport(
        f"s3://{s3_server.bucket}/proc/{uuid.uuid4().hex}", RemoteOptions(**{**FAST.__dict__, "profile": "proc"})
    )
    t.put("k", b"via credential_process")
    assert t.get("k") == b"via credential_process"
    assert json.loads(os.popen(f"{sys.executable} {script}").read())["Version"] == 1


def test_invalid_prefix_key_is_refused_before_any_request(s3_server: S3Server) -> None:
    t = S3Transport(s3_server.bucket, "p", s3_server.options(), env=s3_server.env)
    with pytest.raises(InvalidPathError):
        t.head("..")

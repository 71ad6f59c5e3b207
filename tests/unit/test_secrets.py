"""Secrets from files or the environment, never inline (issue #41): what
``kv_connector_extra_config`` and ``rd2h proxy`` accept, what they refuse, and that no
refusal holds any part of a secret."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rd2h.app.secrets import (
    MAX_SECRET_BYTES,
    SecretSourceError,
    read_secret,
    secret_mode_allowed,
)
from rd2h.app.settings import ConnectorConfigError, Rd2hOptions
from rd2h.cli.proxy import admin_token

SECRET = "s3cret-value-of-28-characters"
KEY = "rq:rUwmh5Sd[8Tv<Y=3m@*FtO.JY-0=g^a1F]B1b"  # 40 Z85 characters
PUBLIC = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"


def _file(tmp_path: Path, text: str, mode: int = 0o600, name: str = "secret") -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("text", [SECRET, SECRET + "\n", SECRET + "\r\n"])
def test_a_file_gives_its_secret_without_one_trailing_line_break(tmp_path, text) -> None:
    assert read_secret("auth_secret", file=_file(tmp_path, text)) == SECRET


def test_a_link_to_a_private_file_is_followed(tmp_path) -> None:
    """Kubernetes mounts a Secret's key as a link into a timestamped folder."""
    target = _file(tmp_path, SECRET)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert read_secret("auth_secret", file=str(link)) == SECRET


@pytest.mark.parametrize(("mode", "shown"), [(0o604, "0604"), (0o660, "0660"),
                                             (0o644, "0644"), (0o460, "0460"),
                                             (0o404, "0404"), (0o450, "0450")])
def test_a_file_open_to_group_or_others_is_refused(tmp_path, mode, shown) -> None:
    """Refused whoever owns it: group write or execute, or any permission for others."""
    path = _file(tmp_path, SECRET, mode)
    with pytest.raises(SecretSourceError) as info:
        read_secret("auth_secret", file=path)
    text = str(info.value)
    assert f"mode {shown}" in text and "0400" in text and path in text
    assert "owned by root" in text and "0440" in text  # states the rule
    assert SECRET not in text


ROOT = os.geteuid() == 0
NOT_ROOT = 12345  # any uid but root


def _owned(path: str, uid: int) -> str:
    os.chown(path, uid, -1)
    return path


@pytest.mark.parametrize("mode", [0o400, 0o600])
def test_an_owner_only_file_is_accepted_whoever_owns_it(tmp_path, mode) -> None:
    path = _file(tmp_path, SECRET, mode)
    assert read_secret("auth_secret", file=path) == SECRET
    if ROOT:
        assert read_secret("auth_secret", file=_owned(path, NOT_ROOT)) == SECRET


@pytest.mark.skipif(not ROOT, reason="needs root to give a file to root and to another uid")
@pytest.mark.parametrize("mode", [0o440, 0o640])
def test_a_group_readable_file_is_accepted_only_when_root_owns_it(tmp_path, mode) -> None:
    """PostgreSQL's rule for its TLS key: what a Kubernetes Secret volume with
    ``defaultMode: 0440`` and ``fsGroup`` gives a non-root pod (root-owned, group-read)."""
    path = _owned(_file(tmp_path, SECRET, mode), 0)
    assert read_secret("auth_secret", file=path) == SECRET
    _owned(path, NOT_ROOT)
    with pytest.raises(SecretSourceError) as info:
        read_secret("auth_secret", file=path)
    text = str(info.value)
    assert f"mode {mode:04o}" in text and f"owned by uid {NOT_ROOT}" in text
    assert "owned by root" in text and SECRET not in text


@pytest.mark.parametrize(("mode", "uid", "ok"), [
    (0o400, 0, True), (0o600, NOT_ROOT, True), (0o440, 0, True), (0o640, 0, True),
    (0o440, NOT_ROOT, False), (0o460, 0, False), (0o404, 0, False), (0o470, 0, False),
    (0o444, 0, False), (0o420, 0, False)])
def test_the_mode_rule(mode, uid, ok) -> None:
    assert secret_mode_allowed(mode, uid) is ok


@pytest.mark.parametrize(("make", "why"), [
    (lambda p: str(p / "missing"), "cannot read"),
    (lambda p: str(p), "not a regular file"),
    (lambda p: _file(p, "", name="empty"), "is empty"),
    (lambda p: _file(p, "\n", name="newline"), "is empty"),
    (lambda p: _file(p, "x" * (MAX_SECRET_BYTES + 1), name="big"), "bytes"),
])
def test_an_unusable_file_is_named(tmp_path, make, why) -> None:
    with pytest.raises(SecretSourceError, match=why):
        read_secret("auth_secret", file=make(tmp_path))


def test_a_file_that_is_not_text_is_refused_without_its_bytes(tmp_path) -> None:
    path = tmp_path / "bin"
    path.write_bytes(b"\xff\xfe" + SECRET.encode())
    path.chmod(0o600)
    with pytest.raises(SecretSourceError, match="not UTF-8") as info:
        read_secret("auth_secret", file=str(path))
    assert SECRET not in str(info.value)


def test_the_environment_gives_its_secret_and_names_a_missing_variable() -> None:
    assert read_secret("auth_secret", env="V", environ={"V": SECRET}) == SECRET
    with pytest.raises(SecretSourceError, match="'V' is not set"):
        read_secret("auth_secret", env="V", environ={})
    with pytest.raises(SecretSourceError, match="not both"):
        read_secret("auth_secret", file="/x", env="V", environ={"V": SECRET})
    assert read_secret("auth_secret") is None


@pytest.mark.parametrize("key", ["auth_secret", "curve_secret_key"])
def test_an_inline_secret_is_refused_naming_the_options_and_not_the_value(key) -> None:
    value = SECRET if key == "auth_secret" else KEY
    with pytest.raises(ConnectorConfigError) as info:
        Rd2hOptions.parse({key: value})
    text = str(info.value)
    assert f"holds '{key}' inline" in text and "vLLM prints" in text
    assert f"'{key}_file'" in text and f"'{key}_env'" in text
    assert value not in text and value[:8] not in text


def test_both_secrets_from_files_and_the_environment(tmp_path) -> None:
    opts = Rd2hOptions.parse(
        {"auth_secret_file": _file(tmp_path, SECRET), "curve_secret_key_env": "CURVE",
         "curve_allowed_keys": [PUBLIC]}, environ={"CURVE": KEY})
    assert opts.auth_secret is not None and opts.auth_secret.get_secret_value() == SECRET
    assert opts.curve_secret_key is not None
    assert opts.curve_secret_key.get_secret_value() == KEY
    assert SECRET not in repr(opts) and KEY not in repr(opts)


def test_a_secret_from_a_file_is_still_checked_without_echoing_it(tmp_path) -> None:
    with pytest.raises(ConnectorConfigError, match="at least 16") as info:
        Rd2hOptions.parse({"auth_secret_file": _file(tmp_path, "short-one")})
    assert "short-one" not in str(info.value)
    with pytest.raises(ConnectorConfigError, match="40 Z85") as info:
        Rd2hOptions.parse({"curve_secret_key_env": "K"}, environ={"K": "y" * 39})
    assert "y" * 39 not in str(info.value)


def test_a_bad_source_is_refused_at_parse_naming_it(tmp_path) -> None:
    with pytest.raises(ConnectorConfigError, match=r"auth_secret_file.*open to group"):
        Rd2hOptions.parse({"auth_secret_file": _file(tmp_path, SECRET, 0o644)})
    with pytest.raises(ConnectorConfigError, match="'auth_secret_file'"):
        Rd2hOptions.parse({"auth_secret_file": ""})


def test_the_vllm_connector_refuses_an_inline_secret_at_start() -> None:
    """What a real engine does when its connector starts (the engine then exits)."""
    pytest.importorskip("vllm")
    from test_vllm_connector import vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.entry.connector import SfaRemoteD2HConnector

    with pytest.raises(ConnectorConfigError, match="inline") as info:
        SfaRemoteD2HConnector(vllm_config("kv_producer", {"auth_secret": SECRET}),
                              KVConnectorRole.SCHEDULER, None)
    assert SECRET not in str(info.value)


def test_the_proxy_admin_token_from_a_file_or_the_environment(tmp_path, capsys) -> None:
    path = _file(tmp_path, SECRET + "\n")
    assert admin_token(None, path, environ={}) == SECRET
    assert admin_token(None, None, environ={"RD2H_PROXY_ADMIN_TOKEN_FILE": path}) == SECRET
    assert admin_token(None, None, environ={"RD2H_PROXY_ADMIN_TOKEN": SECRET}) == SECRET
    assert admin_token(None, None, environ={}) is None
    assert capsys.readouterr().err == ""
    assert admin_token(SECRET, None, environ={}) == SECRET  # allowed, with a warning
    assert "process listing" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not both"):
        admin_token(SECRET, path, environ={})
    with pytest.raises(ValueError, match="open to group") as info:
        admin_token(None, _file(tmp_path, SECRET, 0o644, "open"), environ={})
    assert SECRET not in str(info.value)


def test_rd2h_keys_writes_the_secret_to_a_private_file_and_prints_the_public_key(
        tmp_path, capsys) -> None:
    from rd2h.cli.main import main

    path = tmp_path / "curve"
    assert main(["keys", "--secret-file", str(path)]) == 0
    out = capsys.readouterr().out
    secret = path.read_text().strip()
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(secret) == 40
    assert out.startswith("public: ") and secret not in out
    # the file serves as curve_secret_key_file as it is
    opts = Rd2hOptions.parse({"curve_secret_key_file": str(path), "curve_allowed_keys":
                              [out.split()[1]]})
    assert opts.curve_secret_key is not None
    assert opts.curve_secret_key.get_secret_value() == secret
    assert main(["keys", "--secret-file", str(path)]) == 2  # never overwritten
    assert path.read_text().strip() == secret

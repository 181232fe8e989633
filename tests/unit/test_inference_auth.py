"""Admin-secret rules (inference/auth.py): who needs a secret, and that it is checked."""

from __future__ import annotations

import pytest
from fastapi import HTTPException
from starlette.requests import Request

from prime_composer.config.inference import InferenceConfig
from prime_composer.inference.auth import check_bearer, is_loopback, resolve_admin_secret


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "inference.example"])
def test_non_loopback_hosts(host):
    assert not is_loopback(host)


def test_public_bind_without_secret_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"inference\.secret_env"):
        resolve_admin_secret("0.0.0.0", None)
    monkeypatch.delenv("PC_TEST_SECRET", raising=False)
    with pytest.raises(ValueError, match=r"inference\.secret_env = 'PC_TEST_SECRET'.*unset"):
        resolve_admin_secret("0.0.0.0", "PC_TEST_SECRET")


def test_secret_resolution(monkeypatch):
    assert resolve_admin_secret("127.0.0.1", None) is None
    monkeypatch.setenv("PC_TEST_SECRET", "s3cret-value")
    assert resolve_admin_secret("0.0.0.0", "PC_TEST_SECRET") == "s3cret-value"
    assert resolve_admin_secret("127.0.0.1", "PC_TEST_SECRET") == "s3cret-value"


def test_build_app_fails_before_loading_the_model(monkeypatch):
    from prime_composer.inference.server import build_app

    monkeypatch.setenv("PC_TEST_SECRET", "")
    config = InferenceConfig(
        host="0.0.0.0", secret_env="PC_TEST_SECRET", model={"name": "builtin:does-not-exist"}
    )
    # The secret is checked first: the (invalid) model name is never reached.
    with pytest.raises(ValueError, match=r"inference\.secret_env"):
        build_app(config)


def _request(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "POST", "path": "/update_weights", "headers": headers})


def test_check_bearer():
    check_bearer(_request(None), None)  # no secret configured (loopback): open
    check_bearer(_request("Bearer right"), "right")
    for header, message in [(None, "missing"), ("Basic right", "missing"), ("Bearer wrong", "wrong")]:
        with pytest.raises(HTTPException) as info:
            check_bearer(_request(header), "right")
        assert info.value.status_code == 401 and message in info.value.detail
        assert "right" not in info.value.detail  # the secret is never echoed

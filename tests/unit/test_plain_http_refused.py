"""Plain HTTP between machines is refused at config validation (and so by ``--dry-run``), with the
key and the fix named: the inference server's bind, the orchestrator's ``base_url``, the worker's
weights origin and relays. Loopback stays plain; ``private_network`` says the link is private."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from prime_composer.config.inference import InferenceConfig
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.launch import rl

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml")
PIN = "sha256:" + "ab" * 32


def test_a_plain_inference_bind_off_loopback_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError) as info:
        InferenceConfig(host="10.0.0.2", secret_env="S")
    message = str(info.value)
    assert "inference.host = '10.0.0.2'" in message and "plain HTTP" in message
    assert "inference.tls_cert" in message and "inference.private_network = true" in message
    assert "rl certs" in message


def test_tls_the_flag_or_loopback_make_it_valid(tmp_path: Path) -> None:
    assert InferenceConfig(host="10.0.0.2", secret_env="S", private_network=True).private_network
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    assert InferenceConfig(host="10.0.0.2", secret_env="S", tls_cert=cert, tls_key=key).tls_cert == cert
    assert InferenceConfig(host="127.0.0.1", secret_env="S").host == "127.0.0.1"


def test_a_plain_base_url_to_another_machine_is_refused() -> None:
    with pytest.raises(ValidationError) as info:
        OrchestratorConfig(base_url=["http://127.0.0.1:8000/v1", "http://infer-1:8000/v1"])
    message = str(info.value)
    assert "orchestrator.base_url: http://infer-1:8000/v1 is plain HTTP to another machine" in message
    assert "orchestrator.inference_private_network = true" in message
    assert "inference_tls_fingerprint" in message
    ok = OrchestratorConfig(base_url="http://infer-1:8000/v1", inference_private_network=True)
    assert ok.server_urls == ["http://infer-1:8000/v1"]
    pinned = OrchestratorConfig(base_url="https://infer-1:8000/v1", inference_tls_fingerprint=PIN)
    assert pinned.inference_tls_fingerprint == PIN
    assert OrchestratorConfig(base_url="http://[::1]:8000/v1").server_urls == ["http://[::1]:8000/v1"]


@pytest.mark.parametrize("key", ["weights_origin", "weights_relays"])
def test_plain_weights_sources_off_loopback_need_the_flag(key: str) -> None:
    plain = "http://10.0.0.1:7900"
    values = (
        {"weights_origin": plain}
        if key == "weights_origin"
        else {"weights_origin": f"https://10.0.0.1:7900@{PIN}", "weights_relays": [plain]}
    )
    with pytest.raises(ValidationError, match=r"plain HTTP off loopback.*inference\.private_network = true"):
        InferenceConfig(weights_secret_env="W", **values)
    assert InferenceConfig(weights_secret_env="W", private_network=True, **values).private_network
    loopback = {k: v.replace("10.0.0.1", "127.0.0.1") if isinstance(v, str) else v for k, v in values.items()}
    if key == "weights_relays":
        loopback["weights_relays"] = ["http://127.0.0.1:7901"]
    assert InferenceConfig(weights_secret_env="W", **loopback).weights_origin is not None


def _dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        rl.main(["@", QUICKSTART, "--output-dir", str(tmp_path / "run"), *argv, "--dry-run"])
    return int(exit_info.value.code or 0), capsys.readouterr().err


def test_dry_run_refuses_a_plain_bind_and_accepts_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAIN_HTTP_TEST_SECRET", "x" * 32)
    bind = ["--inference.host", "0.0.0.0", "--inference.secret-env", "PLAIN_HTTP_TEST_SECRET"]
    code, err = _dry_run(capsys, tmp_path, *bind)
    assert code == 2 and "inference.host = '0.0.0.0'" in err and "inference.private_network" in err, err
    assert "Traceback" not in err and "x" * 32 not in err
    code, err = _dry_run(capsys, tmp_path, *bind, "--inference.private-network", "true")
    assert code == 0, err
    assert not (tmp_path / "run").exists()

"""``orchestrator.weights_load_retry`` is what the weight loads retry with: a server that answers
503 (retryable) is called once plus ``max_retries`` times before the step fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_policy_sync import FakeServer, publish

from prime_composer.config.client import RetryConfig
from prime_composer.config.orchestrator import OrchestratorConfig
from prime_composer.orchestrator.policy import PolicySync, WeightSyncError


@pytest.mark.parametrize("max_retries", [0, 2])
def test_a_failing_load_is_tried_one_plus_max_retries_times(tmp_path: Path, max_retries: int) -> None:
    config = OrchestratorConfig.model_validate(
        {"weights_load_retry": {"timeout_s": 5.0, "max_retries": max_retries, "backoff_s": 0.0}}
    )
    fake = FakeServer(status=503)
    publish(tmp_path, 1)
    try:
        sync = PolicySync(tmp_path, fake.url, poll_s=0.01, timeout_s=5, retry=config.weights_load_retry)
        with pytest.raises(WeightSyncError):
            asyncio.run(sync.ensure(1))
    finally:
        fake.httpd.shutdown()
    assert len(fake.calls) == 1 + max_retries


def test_the_default_gives_a_slow_load_its_minutes() -> None:
    assert OrchestratorConfig().weights_load_retry == RetryConfig(timeout_s=600.0, max_retries=3)

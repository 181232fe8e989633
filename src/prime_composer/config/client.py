"""Config of calls to OpenAI-compatible endpoints (hint LLMs, teachers, judges, weight updates).

Every such call goes through ``prime_composer.client.http`` with these settings: a time limit per
attempt, a bounded number of retries with exponential backoff on rate limits (429), server errors
(5xx), timeouts and connection errors, and a cap on the calls in flight.
"""

from __future__ import annotations

from pydantic import Field

from prime_composer.config.base import BaseConfig


class RetryConfig(BaseConfig):
    """Timeouts and retries of one kind of HTTP call."""

    timeout_s: float = Field(default=60.0, gt=0)
    """Time limit of one attempt (connect + wait for the whole answer)."""

    max_retries: int = Field(default=3, ge=0, le=20)
    """Attempts after the first on 429, 5xx, timeouts and connection errors; other 4xx answers
    are never retried (the request itself is wrong)."""

    backoff_s: float = Field(default=0.5, ge=0)
    """Base of the exponential backoff: retry ``k`` waits a random time up to ``backoff_s * 2**k``
    (full jitter), or what the server's ``Retry-After`` asks, whichever is longer."""

    max_backoff_s: float = Field(default=30.0, ge=0)
    """Cap of one wait between attempts (also caps ``Retry-After``)."""

"""Config of the orchestrator's SDPO hint builder (``[orchestrator.sdpo]``).

The orchestrator picks failed rollouts, builds a text hint for the turn where each went wrong, and
renders a teacher context (the same prefix with the hint inserted, through the same chat template)
that the trainer scores the same target-turn tokens under. The loss side (alpha, beta, teacher
weights) is ``trainer.loss.sdpo`` (``config/loss.py``); both must be on together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from prime_composer.config.base import BaseConfig
from prime_composer.config.client import RetryConfig

HintSource = Literal["sibling", "feedback", "template", "llm"]

DEFAULT_SOURCES: tuple[HintSource, ...] = ("feedback", "sibling", "template")

DEFAULT_LLM_INSTRUCTIONS = (
    "You review a failed attempt of an AI assistant at a task. Write one short hint, addressed to "
    "the assistant, that would let it get the marked turn right. State the key fact or correction "
    "directly. Reply with the hint only."
)


class LLMHintConfig(BaseConfig):
    """An OpenAI-compatible chat model that reads a failed trace and writes the hint."""

    base_url: str | None = None
    """Endpoint up to ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``); required when ``llm`` is a source."""

    model: str | None = None
    """Model name sent in the request; required when ``llm`` is a source."""

    api_key_env: str | None = None
    """Environment variable holding the API key (sent as a bearer token); None sends no key. The key
    itself never appears in configs or logs."""

    max_tokens: int = Field(default=256, ge=1)
    """Longest hint the model may write (its reply is also cut to ``max_hint_tokens``)."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature of the hint request."""

    retry: RetryConfig = RetryConfig()
    """Time limit and retries of each hint request; a request that still fails gives no hint from
    this source (counted in ``sdpo/llm_errors``), never a crash."""

    max_concurrent: int = Field(default=8, ge=1)
    """Hint requests in flight at once."""

    instructions: str = DEFAULT_LLM_INSTRUCTIONS
    """System message of the hint request."""

    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra fields of the request body (e.g. ``seed``, ``top_p``, ``chat_template_kwargs``)."""


class HintConfig(BaseConfig):
    """Which rollouts get an SDPO hint, where the hint comes from, and how it is inserted."""

    enabled: bool = False
    """Build hints and teacher contexts each step (needs ``trainer.loss.sdpo.weight > 0``)."""

    reward_threshold: float = 1.0
    """A rollout whose reward is below this is a target (if a hint can be built for it). 1.0 suits
    0/1 rewards: every failed rollout."""

    success_threshold: float | None = None
    """A sibling counts as a success (its reply can be a hint) when its reward is at least this;
    None means ``reward_threshold``."""

    sources: list[HintSource] = Field(default_factory=lambda: list(DEFAULT_SOURCES))
    """Hint sources tried in this order; the first that yields a hint wins. ``sibling``: a successful
    rollout of the same group (never the sample itself); ``feedback``: environment feedback in
    ``Sample.episode.feedback`` (failing-test output, a tool error, a format complaint);
    ``template``: ``<template_dir>/<error kind>.txt``, else ``default.txt``; ``llm``: the model in
    ``[orchestrator.sdpo.llm]`` writes it."""

    template_dir: Path = Path("hints")
    """Folder of hint templates, one ``<error kind>.txt`` each plus ``default.txt`` (relative paths
    resolve against the working directory). Templates use ``{placeholders}``: the task's fields
    (e.g. ``{answer}``), ``{reply}``, ``{feedback}``, ``{error_kind}``, ``{reward}``."""

    metric_error_kinds: dict[str, str] = Field(default_factory=dict)
    """Per-sample environment metrics that name an error kind when they are 0, checked in order,
    e.g. ``{is_integer = "wrong_format"}``. An explicit ``Sample.episode.error_kind`` or a feedback
    kind wins; the fallback kind is ``truncated`` for cut-off rollouts, else ``wrong_answer``."""

    sibling_format: str = "A correct answer to this task was:\n{solution}"
    """How a sibling's reply becomes a hint (``{solution}`` is the reply's text)."""

    feedback_format: str = "Feedback on a previous attempt at this step:\n{feedback}"
    """How environment feedback becomes a hint (``{feedback}`` is its text)."""

    strip_thinking: bool = True
    """Remove ``<think>...</think>`` blocks from a sibling's reply before using it as a hint."""

    hint_format: str = "Hint: {hint}"
    """Wrapper around every hint's text (``{hint}``) before it is inserted."""

    placement: Literal["message", "append"] = "message"
    """``message``: the hint is a new message of role ``hint_role`` right before the target turn.
    ``append``: it is appended (after a blank line) to the last non-assistant message before the
    target turn, for chat templates that reject two user messages in a row."""

    hint_role: Literal["user", "system"] = "user"
    """Role of the hint message with ``placement = "message"``."""

    max_hint_tokens: int = Field(default=256, ge=1)
    """Hints longer than this many tokens (after ``hint_format``) are cut to it."""

    max_hinted_fraction: float = Field(default=1.0, gt=0.0, le=1.0)
    """At most this fraction of a step's samples get a hint (the lowest rewards first)."""

    llm: LLMHintConfig = LLMHintConfig()
    """The LLM hint generator (used only when ``llm`` is in ``sources``)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.sources:
            raise ValueError(
                'orchestrator.sdpo.sources is empty: list at least one of "sibling", "feedback", '
                '"template", "llm"'
            )
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"orchestrator.sdpo.sources lists a source twice: {self.sources}")
        if "llm" in self.sources and (self.llm.base_url is None or self.llm.model is None):
            raise ValueError(
                'orchestrator.sdpo.sources has "llm" but orchestrator.sdpo.llm.base_url or .model is '
                'not set: set both, or remove "llm" from the sources'
            )
        # Compared with the defaults rather than model_fields_set: a resolved config written to
        # JSON and read back sets every field.
        if "llm" not in self.sources and self.llm != LLMHintConfig():
            raise ValueError(
                'orchestrator.sdpo.llm is set but "llm" is not in orchestrator.sdpo.sources: add it '
                "to the sources or remove the [orchestrator.sdpo.llm] table"
            )
        for key, fmt, name in (
            ("hint_format", self.hint_format, "hint"),
            ("sibling_format", self.sibling_format, "solution"),
            ("feedback_format", self.feedback_format, "feedback"),
        ):
            if "{" + name + "}" not in fmt:
                raise ValueError(f"orchestrator.sdpo.{key} must contain {{{name}}}, got {fmt!r}")
        return self

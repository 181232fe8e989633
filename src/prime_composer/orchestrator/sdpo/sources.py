"""Where SDPO hint texts come from: a successful sibling, environment feedback, templates, an LLM.

Each source looks at one ``HintRequest`` (a failed sample, its group and its target turn) and
returns the hint's text, or None when it has nothing to say; ``HintBuilder`` tries them in the
configured order. A source never raises for bad data: a failed LLM call is counted and gives no
hint, like any other rollout problem.

What environments can put on ``Sample.episode`` (copied from ``trace.info``) for these sources:

- ``feedback``: a string (about the last turn), a ``{"text", "turn", "kind"}`` dict, or a list of
  them. ``turn`` counts the rollout's assistant turns from 0 (negative from the end) and names the
  turn the feedback is about: the hint is inserted before that turn. ``kind`` (e.g.
  ``failing_test``, ``tool_error``, ``wrong_format``) picks the template.
- ``error_turn``: the assistant turn the error localizes to (same numbering), when known.
- ``error_kind``: the error kind, for the template source.
"""

from __future__ import annotations

import json
import logging
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_composer.client.http import EndpointClient, read_api_key, redact_url
from prime_composer.config.sdpo import LLMHintConfig
from prime_composer.orchestrator.sample import Sample

logger = logging.getLogger(__name__)

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclass(frozen=True)
class Feedback:
    """One piece of environment feedback about one assistant turn."""

    text: str
    turn: int | None = None
    """Assistant turn it is about (negative counts from the end); None = the last turn."""
    kind: str | None = None


@dataclass
class HintRequest:
    """Everything a hint source may read about one target."""

    sample: Sample
    group: list[Sample]
    """The sample's group (same ``group_id``), the sample itself included."""
    turn: int
    """Index of the target assistant turn in the sample (0-based)."""
    step: int
    """The target turn's step in its episode (``turn`` unless the episode was split in samples)."""
    num_turns: int
    reply: str
    """Text of the target turn as the policy wrote it."""
    messages: list[dict[str, Any]]
    """The trace's messages (text-only content)."""
    error_kind: str
    feedback: list[Feedback] = field(default_factory=list)
    """Feedback about the target turn."""


def parse_feedback(raw: Any) -> list[Feedback] | None:
    """``Sample.episode.feedback`` as a list, or None if it is malformed (counted, not raised)."""
    if raw is None:
        return []
    items = raw if isinstance(raw, list) else [raw]
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(Feedback(text=item))
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            turn, kind = item.get("turn"), item.get("kind")
            if (turn is not None and (not isinstance(turn, int) or isinstance(turn, bool))) or (
                kind is not None and not isinstance(kind, str)
            ):
                return None
            out.append(Feedback(text=item["text"], turn=turn, kind=kind))
        else:
            return None
    return [f for f in out if f.text.strip()]


def feedback_for_turn(feedback: list[Feedback], turn: int, num_turns: int) -> list[Feedback]:
    """The feedback entries about ``turn`` (entries without a turn are about the last one)."""
    return [f for f in feedback if ((f.turn if f.turn is not None else -1) % num_turns) == turn]


def error_kind(sample: Sample, feedback: list[Feedback], metric_error_kinds: dict[str, str]) -> str:
    """The key of the template to use: explicit, from feedback, from a failed metric, or generic."""
    explicit = sample.episode.error_kind
    if isinstance(explicit, str) and explicit:
        return explicit
    for f in feedback:
        if f.kind:
            return f.kind
    for metric, kind in metric_error_kinds.items():
        if sample.metrics.get(metric) == 0:
            return kind
    return "truncated" if sample.is_truncated else "wrong_answer"


def strip_thinking(text: str) -> str:
    return _THINK.sub("", text).strip()


def sibling_hint(
    request: HintRequest, success_threshold: float, sibling_format: str, replies: dict[int, dict[int, str]]
) -> str | None:
    """A hint from the best successful sibling: its reply at the target's step of the episode, or
    its last reply when its episode is shorter (``replies``: ``id(sample)`` -> step -> text). For a
    single-turn rollout that is the sibling's answer."""
    best: Sample | None = None
    for s in request.group:
        if s is request.sample or s.error is not None or s.reward < success_threshold:
            continue
        if best is None or s.reward > best.reward:
            best = s
    if best is None:
        return None
    steps = replies.get(id(best), {})
    solution = (steps.get(request.step) or (steps[max(steps)] if steps else "")).strip()
    return sibling_format.replace("{solution}", solution) if solution else None


def feedback_hint(request: HintRequest, feedback_format: str) -> str | None:
    if not request.feedback:
        return None
    return feedback_format.replace("{feedback}", "\n".join(f.text.strip() for f in request.feedback))


class TemplateHints:
    """Hint templates ``<dir>/<error kind>.txt`` (``str.format`` placeholders), with ``default.txt``."""

    def __init__(self, template_dir: Path) -> None:
        if not template_dir.is_dir():
            raise ValueError(
                f"orchestrator.sdpo.template_dir {str(template_dir)!r} is not a folder (relative paths "
                'resolve against the working directory): point it at the hint templates or remove "template" '
                "from orchestrator.sdpo.sources"
            )
        self.templates = {p.stem: p.read_text().strip() for p in sorted(template_dir.glob("*.txt"))}
        if "default" not in self.templates:
            raise ValueError(
                f"orchestrator.sdpo.template_dir {str(template_dir)!r} has no default.txt (used for error "
                "kinds without their own template): add one"
            )
        for name, text in self.templates.items():
            try:
                list(string.Formatter().parse(text))
            except ValueError as e:
                raise ValueError(
                    f"hint template {template_dir / (name + '.txt')}: {e} (write literal braces as {{{{ }}}})"
                ) from e

    def hint(self, request: HintRequest) -> tuple[str, str] | None:
        """``(text, template name)``: the error kind's template if all its placeholders are known,
        else ``default``; None if neither can be filled."""
        fields = template_fields(request)
        for name in (request.error_kind, "default"):
            template = self.templates.get(name)
            if template is None:
                continue
            needed = {f for _, f, _, _ in string.Formatter().parse(template) if f}
            if needed <= fields.keys():
                return template.format_map(fields), name
        return None


def template_fields(request: HintRequest) -> dict[str, Any]:
    """Placeholder values: the task's scalar fields, then ``reply``, ``feedback``, ``error_kind``,
    ``reward`` (empty feedback is absent, so a template that needs it is skipped)."""
    task = request.sample.episode.task
    fields: dict[str, Any] = {}
    if isinstance(task, dict):
        fields.update({k: v for k, v in task.items() if isinstance(v, str | int | float | bool)})
    fields.update(reply=request.reply, error_kind=request.error_kind, reward=request.sample.reward)
    if request.feedback:
        fields["feedback"] = "\n".join(f.text.strip() for f in request.feedback)
    return fields


class LLMHints:
    """Asks an OpenAI-compatible chat model for a hint. Failures give None and are counted."""

    def __init__(self, cfg: LLMHintConfig) -> None:
        assert cfg.base_url is not None and cfg.model is not None  # enforced by HintConfig
        self.cfg = cfg
        self.client = EndpointClient(
            cfg.base_url,
            retry=cfg.retry,
            api_key=read_api_key(cfg.api_key_env, "orchestrator.sdpo.llm.api_key_env"),
            max_concurrency=cfg.max_concurrent,
        )
        self.num_errors = 0
        self.last_error: str | None = None

    def request_body(self, request: HintRequest) -> dict[str, Any]:
        return {
            "model": self.cfg.model,
            "messages": [
                {"role": "system", "content": self.cfg.instructions},
                {"role": "user", "content": describe_trace(request)},
            ],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            **self.cfg.extra_body,
        }

    async def hint(self, request: HintRequest) -> str | None:
        result = await self.client.chat_completion(self.request_body(request))
        content = result.data["choices"][0]["message"].get("content") if result.ok else None
        if isinstance(content, str) and content.strip():
            return content.strip()
        # A failed teacher call is data, not a crash.
        self.num_errors += 1
        self.last_error = result.error or "empty hint"
        logger.warning("LLM hint request to %s failed: %s", redact_url(self.client.base_url), self.last_error)
        return None

    async def aclose(self) -> None:
        await self.client.aclose()


def describe_trace(request: HintRequest) -> str:
    """The hint request's user message: task data, the trace up to the target turn, the outcome."""
    lines = []
    task = request.sample.episode.task
    if task:
        lines += ["Task data:", json.dumps(task, ensure_ascii=False, default=str), ""]
    lines.append("Conversation:")
    seen = 0
    for message in request.messages:
        role = message.get("role", "?")
        if role == "assistant":
            if seen == request.turn:
                break
            seen += 1
        lines.append(f"[{role}] {message.get('content', '')}")
    lines.append(f"[assistant, the turn that went wrong] {request.reply}")
    lines += ["", f"Reward: {request.sample.reward} (error kind: {request.error_kind})"]
    if request.feedback:
        lines += ["Environment feedback:", *(f.text for f in request.feedback)]
    return "\n".join(lines)

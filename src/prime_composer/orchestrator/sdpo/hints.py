"""SDPO targets: pick failed rollouts, build a hint for the turn that went wrong, render the teacher.

For each step's kept samples (``HintBuilder.apply``):

1. **candidates**: no error, reward below ``reward_threshold``; lowest reward first; at most
   ``max_hinted_fraction`` of the step's samples end up hinted.
2. **target turn**: ``episode.error_turn``, else the turn the environment's feedback is about, else
   the last assistant turn (a single-turn rollout: the whole completion). The target span is that
   turn's policy tokens in ``completion_ids``; tool and environment tokens are never in it. For
   multi-turn episodes the rollout stage has already located the error turn (a tool error, a
   non-zero exit, the change a failing test run blames: ``episode.localize_error``) and written
   it with its feedback; turns and their spans come from ``episode.turns``.
3. **hint**: the configured sources in order (``sources``): sibling success (for a multi-turn
   target, the sibling's reply at the same step of its episode), environment feedback, template,
   LLM. The text is wrapped by ``hint_format`` and cut to ``max_hint_tokens``.
4. **teacher context**: the messages before the target turn with the hint inserted, rendered with
   the same chat template (and the same tool definitions, ``episode.tools``) after checking that
   the same messages without the hint render to the text of the student's tokens. The teacher
   keeps the student's own tokens up to where the texts differ and encodes only the rest
   (``chat_render.splice_prompt``): a token-in rollout's history is token-exact, not a re-encoding.
   Cut in the middle to fit ``seq_len`` with the target span.

The result is written on the sample: ``set_sdpo_target(sample, span, teacher_prefix_ids)`` (``Sample.channels["sdpo"]``, ``target.py``) and
(the target also records the hint, its source and template). Packing then puts the student span in ``sdpo_mask`` and
``teacher_prefix_ids + completion_ids[start:end]`` in the micro-batch's teacher rows.

Samples that cannot be hinted are counted by reason in the step metrics
(``sdpo/skipped/<reason>``), never silently.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prime_composer.config.sdpo import HintConfig
from prime_composer.orchestrator.chat_render import ChatRenderer, splice_prompt
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo import render
from prime_composer.orchestrator.sdpo.sources import (
    HintRequest,
    LLMHints,
    TemplateHints,
    error_kind,
    feedback_for_turn,
    feedback_hint,
    parse_feedback,
    sibling_hint,
    strip_thinking,
)
from prime_composer.orchestrator.sdpo.target import clear_sdpo_target, set_sdpo_target

logger = logging.getLogger(__name__)


@dataclass
class HintStats:
    """What hinting did to one step, for the orchestrator's metrics."""

    num_samples: int = 0
    num_candidates: int = 0
    """Samples below the reward threshold."""
    num_hinted: int = 0
    num_teacher_truncated: int = 0
    """Hinted samples whose teacher context was cut in the middle to fit ``seq_len``."""
    sources: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    """Candidates left without a hint, by reason."""
    num_llm_errors: int = 0

    def metrics(self, source_names: Sequence[str]) -> dict[str, float]:
        out: dict[str, float] = {
            "sdpo/num_hinted": self.num_hinted,
            "sdpo/hinted_fraction": self.num_hinted / self.num_samples if self.num_samples else 0.0,
            "sdpo/num_candidates": self.num_candidates,
            "sdpo/teacher_truncated": self.num_teacher_truncated,
        }
        out.update({f"sdpo/source/{name}": self.sources[name] for name in source_names})
        out.update({f"sdpo/skipped/{reason}": n for reason, n in sorted(self.skipped.items())})
        if "llm" in source_names:
            out["sdpo/llm_errors"] = self.num_llm_errors
        return out


@dataclass
class _Built:
    span: tuple[int, int]
    teacher_prefix: list[int]
    source: str
    detail: str | None
    """Which template, for the template source."""
    hint: str
    truncated: bool


class HintBuilder:
    """Builds SDPO targets for a step's samples (see the module docstring)."""

    def __init__(
        self,
        cfg: HintConfig,
        tokenizer: Any,
        seq_len: int,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``tokenizer`` must be the policy's (its chat template rendered the rollouts);
        ``chat_template_kwargs`` are the ones the rollout requests sent (``sampling.extra_body``)."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "orchestrator.sdpo needs a tokenizer with a chat template to render hinted contexts"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, chat_template_kwargs)
        self.seq_len = seq_len
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.success_threshold = (
            cfg.reward_threshold if cfg.success_threshold is None else cfg.success_threshold
        )
        self.templates = TemplateHints(cfg.template_dir) if "template" in cfg.sources else None
        self.llm = LLMHints(cfg.llm) if "llm" in cfg.sources else None
        self._warned_render = False

    async def apply(self, samples: list[Sample]) -> HintStats:
        """Set SDPO targets on ``samples`` in place (any earlier targets are cleared)."""
        stats = HintStats(num_samples=len(samples))
        for s in samples:
            clear_sdpo_target(s)
        groups: dict[int, list[Sample]] = defaultdict(list)
        for s in samples:
            groups[s.group_id].append(s)
        candidates = sorted(
            (i for i, s in enumerate(samples) if s.error is None and s.reward < self.cfg.reward_threshold),
            key=lambda i: (samples[i].reward, i),
        )
        stats.num_candidates = len(candidates)
        limit = math.floor(self.cfg.max_hinted_fraction * len(samples) + 1e-9)
        llm_errors_before = self.llm.num_errors if self.llm else 0
        replies = self._last_replies(samples) if "sibling" in self.cfg.sources else {}
        # Waves of at most the remaining budget, so the LLM is not asked for hints we would drop.
        position = 0
        while position < len(candidates) and stats.num_hinted < limit:
            wave = candidates[position : position + limit - stats.num_hinted]
            position += len(wave)
            results = await asyncio.gather(
                *(self._build(samples[i], groups[samples[i].group_id], replies) for i in wave)
            )
            for i, result in zip(wave, results, strict=True):
                sample = samples[i]
                if isinstance(result, str):
                    stats.skipped[result] += 1
                    continue
                set_sdpo_target(
                    sample,
                    result.span,
                    result.teacher_prefix,
                    source=result.source,
                    hint=result.hint,
                    template=result.detail,
                )
                stats.num_hinted += 1
                stats.sources[result.source] += 1
                stats.num_teacher_truncated += int(result.truncated)
        if position < len(candidates):
            stats.skipped["over_fraction"] = len(candidates) - position
        if stats.skipped["render_mismatch"] and not self._warned_render:
            self._warned_render = True  # once: the metric sdpo/skipped/render_mismatch keeps counting
            logger.warning(
                "SDPO: %d failed rollouts get no hint because the chat template, applied to their messages, "
                "does not reproduce their prompt tokens (other chat_template_kwargs, tools, or a template "
                "that rewrites earlier turns); see sdpo/skipped/render_mismatch",
                stats.skipped["render_mismatch"],
            )
        if self.llm is not None:
            stats.num_llm_errors = self.llm.num_errors - llm_errors_before
        return stats

    def _last_replies(self, samples: list[Sample]) -> dict[int, dict[int, str]]:
        """Text of every successful sample's assistant turns by step (sibling solutions); a
        single-turn sample has just step 0."""
        out: dict[int, dict[int, str]] = {}
        for s in samples:
            if s.error is None and s.reward >= self.success_threshold:
                texts = {}
                for step, (start, end) in zip(_steps(s), _spans(s), strict=True):
                    text = self.tokenizer.decode(s.completion_ids[start:end], skip_special_tokens=True)
                    texts[step] = strip_thinking(text) if self.cfg.strip_thinking else text.strip()
                if texts:
                    out[id(s)] = texts
        return out

    async def _build(
        self, sample: Sample, group: list[Sample], replies: dict[int, dict[int, str]]
    ) -> _Built | str:
        """The sample's target, or the reason it gets none."""
        cfg = self.cfg
        turns = _spans(sample)
        if not turns:
            return "no_policy_tokens"
        messages = render.text_messages(sample.episode.messages)
        if not messages:
            return "no_messages"
        feedback = parse_feedback(sample.episode.feedback)
        if feedback is None:
            return "bad_feedback"
        turn = self._target_turn(sample, feedback, len(turns))
        if turn is None:
            return "bad_error_turn"
        start, end = turns[turn]
        # Packing keeps prompt + completion[: seq_len - len(prompt)] of the student.
        end = min(end, self.seq_len - len(sample.prompt_ids))
        if end <= start:
            return "student_truncated"
        context = _turn_context(sample, messages, turn)
        if context is None:
            return "messages_mismatch"
        tools = sample.episode.tools if sample.episode.render_tools else None
        student_context = sample.prompt_ids + sample.completion_ids[:start]
        student_text = self.renderer.text(context, tools)
        if self.renderer.decode(student_context) != student_text:
            return "render_mismatch"

        turn_feedback = feedback_for_turn(feedback, turn, len(turns))
        request = HintRequest(
            sample=sample,
            group=group,
            turn=turn,
            step=_steps(sample)[turn],
            num_turns=len(turns),
            reply=self.tokenizer.decode(sample.completion_ids[start:end], skip_special_tokens=True),
            messages=messages,
            error_kind=error_kind(sample, turn_feedback, cfg.metric_error_kinds),
            feedback=turn_feedback,
        )
        found = await self._hint_text(request, replies)
        if found is None:
            return "no_hint"
        source, text, detail = found
        hint = self._cut(cfg.hint_format.replace("{hint}", text))

        teacher_text = self.renderer.text(render.with_hint(context, hint, cfg), tools)
        prefix = splice_prompt(self.renderer, student_context, student_text, teacher_text)
        kwargs = {**self.template_kwargs, **({"tools": tools} if tools else {})}
        task_ids = render.task_statement_ids(self.tokenizer, context, kwargs)
        fitted = render.fit_teacher(prefix, student_context, task_ids, end - start, self.seq_len)
        if fitted is None:
            return "teacher_too_long"
        teacher_prefix, span_len = fitted
        return _Built(
            span=(start, start + span_len),
            teacher_prefix=teacher_prefix,
            source=source,
            detail=detail,
            hint=hint,
            truncated=len(teacher_prefix) < len(prefix),
        )

    def _target_turn(self, sample: Sample, feedback: list, num_turns: int) -> int | None:
        explicit = sample.episode.error_turn
        if explicit is None:
            located = [f.turn for f in feedback if f.turn is not None]
            explicit = located[0] if located else -1
        if (
            not isinstance(explicit, int)
            or isinstance(explicit, bool)
            or not -num_turns <= explicit < num_turns
        ):
            return None
        return explicit % num_turns

    async def _hint_text(
        self, request: HintRequest, replies: dict[int, dict[int, str]]
    ) -> tuple[str, str, str | None] | None:
        """``(source, text, template name)`` from the first source that yields a hint."""
        cfg = self.cfg
        for source in cfg.sources:
            text: str | None = None
            detail: str | None = None
            if source == "sibling":
                text = sibling_hint(request, self.success_threshold, cfg.sibling_format, replies)
            elif source == "feedback":
                text = feedback_hint(request, cfg.feedback_format)
            elif source == "template":
                assert self.templates is not None
                found = self.templates.hint(request)
                text, detail = found if found else (None, None)
            elif source == "llm":
                assert self.llm is not None
                text = await self.llm.hint(request)
            if text and text.strip():
                return source, text.strip(), detail
        return None

    def _cut(self, hint: str) -> str:
        ids = self.tokenizer.encode(hint, add_special_tokens=False)
        if len(ids) <= self.cfg.max_hint_tokens:
            return hint
        return self.tokenizer.decode(ids[: self.cfg.max_hint_tokens], skip_special_tokens=True)


def _spans(sample: Sample) -> list[tuple[int, int]]:
    """Token spans of the sample's assistant turns: its turn records, else the runs of mask 1."""
    turns = sample.episode.turns
    if turns:
        return [tuple(t.span) for t in turns]  # type: ignore[misc]
    return render.assistant_turns(sample.completion_mask)


def _steps(sample: Sample) -> list[int]:
    """Each assistant turn's step in its episode (a split episode's later samples start past 0)."""
    turns = sample.episode.turns
    return (
        [t.index for t in turns]
        if turns
        else list(range(len(render.assistant_turns(sample.completion_mask))))
    )


def _turn_context(sample: Sample, messages: list[dict[str, Any]], turn: int) -> list[dict[str, Any]] | None:
    """The messages before the sample's ``turn``-th assistant turn."""
    turns = sample.episode.turns
    index = turns[turn].message_index if turns else None
    if index is not None:
        if index > len(messages) or (index < len(messages) and messages[index].get("role") != "assistant"):
            return None
        return list(messages[:index])
    return render.turn_context(messages, turn)

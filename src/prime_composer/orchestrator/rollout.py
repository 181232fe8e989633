"""Run groups of rollouts through verifiers environments and turn them into ``Sample``s.

``RolloutRunner`` holds the loaded environments' serving resources (verifiers' interception
pool, on 127.0.0.1) for as long as it is entered. ``run_group`` plays ``group_size`` episodes of
one task against the inference server at ``base_url``, at most ``rollout.max_concurrent``
episodes at a time across all groups, and returns the Samples of every trainable trace: prompt
and completion token ids, sampled logprobs, reward and metrics. Chat environments make one chat
call per segment (``harness.py``); environments with tools run the token-in agent loop
(``agent_harness.py``).

**Samples from turns** (PRIME-RL's rule). Consecutive model calls of an episode merge into one
Sample while each prompt extends the previous turn's tokens: the completion is everything after
the first prompt, the policy's tokens with mask 1 and their logprobs, the tokens between turns
(tool results, user turns, template markup) with mask 0 and logprob 0. A turn whose prompt does
not extend them (a chat template that rewrites history) starts a new Sample; all Samples of an
episode carry its reward, so they share the group's advantage. Each Sample keeps one
``TurnInfo`` per assistant turn on ``episode.turns`` (token span, tool calls and results, exit
codes, timing), the conversation on ``episode.messages`` (``Sample.episode``, an
``EpisodeRecord``) and, for agent episodes, where the error is (``episode.error_turn``,
``episode.feedback``: ``episode.localize_error`` unless the
environment said so itself), which SDPO's hint targeting reads.

A bad rollout is data, not a crash: a server error, missing token ids or logprobs, or an
exception anywhere in the environment gives a ``Sample`` with ``error`` set, reward 0 and an
empty completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.env import RunSlot

from prime_composer.config.env import RolloutConfig, SamplingConfig
from prime_composer.orchestrator.agent_harness import AGENT_KEY, forget_trace
from prime_composer.orchestrator.agent_task import close_sandboxes
from prime_composer.orchestrator.envs import LoadedEnv
from prime_composer.orchestrator.episode import BUDGET_STOPS, AgentEpisode, TurnInfo, localize_error
from prime_composer.orchestrator.generate import close_clients
from prime_composer.orchestrator.harness import TURNS_KEY, TurnRecord
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.sample import Sample

logger = logging.getLogger(__name__)

API_KEY_VAR = "PRIME_COMPOSER_INFERENCE_API_KEY"
"""Environment variable whose value is sent as the inference server's API key ("EMPTY" if unset)."""


class TokenError(ValueError):
    """The server's answer can't be turned into training tokens."""


@dataclass(frozen=True)
class GroupKeys:
    """Bookkeeping every Sample of a group carries."""

    example_id: int
    group_id: int
    policy_step: int


class RolloutRunner:
    """Runs rollouts of loaded environments against one OpenAI-compatible endpoint.

    Use as ``async with RolloutRunner(...) as runner: await runner.run_group(...)``.
    """

    def __init__(
        self,
        envs: Sequence[LoadedEnv],
        *,
        base_url: str,
        model: str,
        sampling: SamplingConfig | None = None,
        rollout: RolloutConfig | None = None,
        api_key_var: str = API_KEY_VAR,
    ) -> None:
        self.envs = list(envs)
        self.model = model
        self.sampling = sampling or SamplingConfig()
        self.rollout = rollout or RolloutConfig()
        self.client = vf.EvalClientConfig(base_url=base_url, api_key_var=api_key_var)
        self._stack: contextlib.AsyncExitStack | None = None
        self._semaphore: asyncio.Semaphore | None = None

    async def __aenter__(self) -> RolloutRunner:
        self._stack = contextlib.AsyncExitStack()
        try:
            for loaded in self.envs:
                await self._stack.enter_async_context(loaded.env.serving())
        except BaseException:
            await self._stack.aclose()
            raise
        self._semaphore = asyncio.Semaphore(self.rollout.max_concurrent)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._stack = self._semaphore = None
        await close_clients()
        await asyncio.to_thread(close_sandboxes)

    async def run_group(
        self,
        loaded: LoadedEnv,
        task: vf.Task,
        *,
        group_size: int,
        example_id: int,
        group_id: int,
        policy_step: int,
        sampling: SamplingConfig | None = None,
    ) -> list[Sample]:
        """Play ``group_size`` episodes of ``task``; one Sample per trainable trace, never raises
        for a failed rollout. ``policy_step`` is the weights version live when the group starts;
        ``sampling`` overrides the runner's sampling for this group (e.g. greedy evaluation)."""
        if self._semaphore is None:
            raise RuntimeError("RolloutRunner.run_group needs `async with RolloutRunner(...)` first")
        keys = GroupKeys(example_id, group_id, policy_step)
        episodes = await asyncio.gather(
            *(self._episode(loaded, task, group_id, i, sampling or self.sampling) for i in range(group_size)),
            return_exceptions=True,
        )
        samples: list[Sample] = []
        for episode in episodes:
            if isinstance(episode, BaseException):
                if not isinstance(episode, Exception):
                    raise episode  # cancellation and interrupts propagate
                samples.append(_error_sample(f"{type(episode).__name__}: {episode}", loaded.label, keys))
            else:
                samples.extend(episode_samples(episode, loaded.label, keys))
        return samples

    async def _episode(
        self, loaded: LoadedEnv, task: vf.Task, group_id: int, rollout_index: int, sampling: SamplingConfig
    ) -> vf.Episode:
        ctx = vf.ModelContext(
            model=self.model,
            client=self.client,
            sampling=request_sampling(sampling, group_id, rollout_index),
        )
        return await loaded.env.run_slot(RunSlot(task), ctx, self._semaphore)


def request_sampling(sampling: SamplingConfig, group_id: int, rollout_index: int) -> vf.SamplingConfig:
    """The request's sampling fields; a per-request seed only when ``sampling.seed`` is set (a
    shared seed would make every rollout of a group identical)."""
    fields: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
    }
    optional = {
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "stop": sampling.stop,
        "repetition_penalty": sampling.repetition_penalty,
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    fields.update(sampling.extra_body)
    if sampling.seed is not None:
        fields["seed"] = derive_seed(sampling.seed, group_id, rollout_index)
    return vf.SamplingConfig.model_validate(fields)


def derive_seed(seed: int, group_id: int, rollout_index: int) -> int:
    """A 31-bit seed that differs across groups and rollouts and is stable across runs."""
    digest = hashlib.blake2b(f"{seed}:{group_id}:{rollout_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def episode_samples(episode: vf.Episode, env_label: str, keys: GroupKeys) -> list[Sample]:
    """The Samples of every trainable trace of a finished episode (an error Sample if it has none)."""
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    if not traces:
        error = _describe(episode.errors) or "episode produced no trainable trace"
        return [_error_sample(error, env_label, keys)]
    episode_error = _describe(episode.errors)
    return [s for trace in traces for s in trace_samples(trace, env_label, keys, episode_error=episode_error)]


def trace_samples(
    trace: vf.Trace,
    env_label: str,
    keys: GroupKeys,
    *,
    episode_error: str | None = None,
) -> list[Sample]:
    """The Samples of one trace (one per merged segment of its turns), or one error Sample."""
    record = episode_record(trace, env_label)
    error = episode_error or (None if trace.ok else _describe(trace.errors) or "rollout failed")
    agent: AgentEpisode | None = trace.info.get(AGENT_KEY)
    if agent is not None:
        record.messages = agent.messages
        return _agent_samples(trace, agent, record, keys, error)
    records: list[TurnRecord] = trace.info.get(TURNS_KEY, [])
    if error is None and not records:
        error = f"the rollout made no model call (stop: {trace.stop_condition})"
    segments: list[Segment] = []
    if error is None:
        try:
            segments = assemble_tokens(records)
        except TokenError as e:
            error = str(e)
    if error is not None:
        prompt = (records[0]["prompt_token_ids"] if records else None) or []
        return [_error_sample(error, env_label, keys, prompt_ids=list(prompt), episode=record)]
    assistant_at = [i for i, m in enumerate(record.messages) if m.get("role") == "assistant"]
    truncated = records[-1]["finish_reason"] == "length" or trace.is_truncated
    samples = []
    for segment in segments:
        turns = [
            TurnInfo(
                index=k,
                span=span,
                message_index=assistant_at[k] if len(assistant_at) == len(records) else None,
                finish_reason=records[k]["finish_reason"],
            )
            for k, span in zip(segment.turns, segment.spans, strict=True)
        ]
        samples.append(
            _sample(
                segment, trace.reward, truncated, _trace_metrics(trace), replace(record, turns=turns), keys
            )
        )
    return samples


@dataclass
class Segment:
    """The tokens of consecutive turns that extend each other: one Sample's worth."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    """Indices of the episode's turns in this segment, in order."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """Each of those turns' policy tokens: ``completion_ids[start:end]``."""


class TokenTurn(Protocol):
    """One model call in segment form (``episode.AgentTurn`` is one)."""

    @property
    def new_segment(self) -> bool: ...
    @property
    def prompt_ids(self) -> list[int]:
        """The whole prompt when ``new_segment``, else the tokens added since the previous reply."""
        ...

    @property
    def completion_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float]: ...


@dataclass(frozen=True)
class _Turn:
    new_segment: bool
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


def assemble_segments(turns: Sequence[TokenTurn]) -> list[Segment]:
    """Merge consecutive turns into segments (see the module docstring)."""
    segments: list[Segment] = []
    for k, turn in enumerate(turns):
        if turn.new_segment or not segments:
            segments.append(Segment(prompt_ids=list(turn.prompt_ids)))
            segment = segments[-1]
        else:
            segment = segments[-1]
            segment.completion_ids += turn.prompt_ids
            segment.logprobs += [0.0] * len(turn.prompt_ids)
            segment.mask += [0] * len(turn.prompt_ids)
        start = len(segment.completion_ids)
        segment.completion_ids += turn.completion_ids
        segment.logprobs += turn.logprobs
        segment.mask += [1] * len(turn.completion_ids)
        segment.turns.append(k)
        segment.spans.append((start, len(segment.completion_ids)))
    return segments


def assemble_tokens(turns: Sequence[TurnRecord]) -> list[Segment]:
    """The segments of a chat rollout's calls, from the server's ``prompt_token_ids``: a prompt that
    starts with everything before it extends the segment, any other starts a new one.

    Raises ``TokenError`` when a call has no token ids or logprobs, or they disagree in length."""
    for k, turn in enumerate(turns):
        if turn["prompt_token_ids"] is None or turn["completion_token_ids"] is None:
            raise TokenError(
                f"turn {k}: the server returned no token ids; it must honour `return_token_ids` "
                "(vLLM >= 0.10.2 semantics: top-level prompt_token_ids, choices[i].token_ids)"
            )
        if turn["completion_logprobs"] is None:
            raise TokenError(f"turn {k}: the server returned no logprobs; it must honour `logprobs: true`")
        if len(turn["completion_logprobs"]) != len(turn["completion_token_ids"]):
            raise TokenError(
                f"turn {k}: {len(turn['completion_token_ids'])} completion token ids but "
                f"{len(turn['completion_logprobs'])} logprobs"
            )
    token_turns: list[_Turn] = []
    context: list[int] | None = None
    for turn in turns:
        prompt = list(turn["prompt_token_ids"] or [])
        completion = list(turn["completion_token_ids"] or [])
        extends = context is not None and prompt[: len(context)] == context
        added = prompt[len(context) :] if extends and context is not None else prompt
        token_turns.append(_Turn(not extends, added, completion, list(turn["completion_logprobs"] or [])))
        context = prompt + completion
    return assemble_segments(token_turns)


def _agent_samples(
    trace: vf.Trace, episode: AgentEpisode, record: EpisodeRecord, keys: GroupKeys, error: str | None
) -> list[Sample]:
    env_label = record.env
    forget_trace(trace.id)
    logger.info(
        "rollout done: id=%s task=%s reward=%.3f turns=%d stop=%s",
        trace.id,
        record.task_id if record.task_id is not None else record.task_idx,
        trace.reward or 0.0,
        len(episode.turns),
        error or episode.stop or trace.stop_condition,
    )
    if error is None and not episode.turns:
        error = f"the episode made no model call (stop: {episode.stop or trace.stop_condition})"
    if error is not None:
        prompt = episode.turns[0].prompt_ids if episode.turns else []
        return [_error_sample(error, env_label, keys, prompt_ids=list(prompt), episode=record)]
    # The environment's error keys are replaced by each segment's own (``_error_targets``).
    record = replace(
        record,
        tools=episode.tools,
        render_tools=episode.rendered_tools,
        tool_call_format=episode.tool_call_format,
        stop=episode.stop or trace.stop_condition or "timeout",
        feedback=None,
        error_turn=None,
        error_kind=None,
    )
    metrics = {**_trace_metrics(trace), **_agent_metrics(episode)}
    truncated = record.stop in BUDGET_STOPS or episode.turns[-1].finish_reason == "length" or trace.is_timeout
    segments = assemble_segments(episode.turns)
    targets = _error_targets(trace, episode, segments)
    samples = []
    for number, segment in enumerate(segments):
        turns = [
            TurnInfo.of(episode.turns[k], span) for k, span in zip(segment.turns, segment.spans, strict=True)
        ]
        seg_record = replace(
            record, **targets[number], turns=turns, segment=number, num_segments=len(segments)
        )
        samples.append(_sample(segment, trace.reward, truncated, metrics, seg_record, keys))
    return samples


def _error_targets(trace: vf.Trace, episode: AgentEpisode, segments: list[Segment]) -> list[dict[str, Any]]:
    """Per segment, the SDPO keys (``error_turn``, ``feedback``, ``error_kind``) in its own turn
    numbering. The environment's own ``trace.info`` keys (episode turn numbers, negative from the
    end, feedback without a turn is about the last one) win; ``localize_error`` fills in the error
    turn and its feedback when the environment named no error turn."""
    num_turns = len(episode.turns)
    where = {k: (number, j) for number, seg in enumerate(segments) for j, k in enumerate(seg.turns)}

    def valid(turn: Any) -> bool:
        return isinstance(turn, int) and not isinstance(turn, bool) and -num_turns <= turn < num_turns

    def local(turn: Any, number: int) -> int | None:
        """``turn`` (episode numbering) as a turn of segment ``number``, None if it is not in it."""
        if not valid(turn):
            return None
        found = where[turn % num_turns]
        return found[1] if found[0] == number else None

    raw = trace.info.get("feedback")
    entries = [] if raw is None else raw if isinstance(raw, list) else [raw]
    error_turn = trace.info.get("error_turn")
    localized = localize_error(episode) if error_turn is None else None
    if localized is not None:
        error_turn = localized[0]
        entries = [*entries, {"text": localized[2], "turn": localized[0], "kind": localized[1]}]
    targets: list[dict[str, Any]] = []
    for number in range(len(segments)):
        target: dict[str, Any] = {}
        if "error_kind" in trace.info:
            target["error_kind"] = trace.info["error_kind"]
        if error_turn is not None and not valid(error_turn):
            if number == len(segments) - 1:
                target["error_turn"] = error_turn  # invalid: the hint builder counts it as a bad error turn
        elif error_turn is not None and (turn := local(error_turn, number)) is not None:
            target["error_turn"] = turn
        feedback = []
        for entry in entries:
            if isinstance(entry, str):
                entry = {"text": entry}
            turn = entry.get("turn") if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or (
                turn is not None and (not isinstance(turn, int) or isinstance(turn, bool))
            ):
                if number == len(segments) - 1:
                    feedback.append(entry)  # malformed: the hint builder counts it as bad feedback
                continue
            mapped = local(-1 if turn is None else turn, number)
            if mapped is not None:
                feedback.append({**entry, "turn": mapped})
        if feedback:
            target["feedback"] = feedback
        targets.append(target)
    return targets


def _agent_metrics(episode: AgentEpisode) -> dict[str, float]:
    results = [r for turn in episode.turns for r in turn.tool_results]
    return {
        "agent/num_tool_calls": float(len(results)),
        "agent/tool_errors": float(sum(not r.ok for r in results)),
        "agent/malformed_calls": float(sum(len(turn.malformed) for turn in episode.turns)),
        "agent/test_runs": float(sum(r.name == "run_tests" for r in results)),
        # MCP servers' tools apart (orchestrator/mcp_tools.py): their calls, failures and time.
        "agent/mcp_calls": float(sum(r.external for r in results)),
        "agent/mcp_errors": float(sum(r.external and not r.ok for r in results)),
        "agent/mcp_call_s": sum(r.duration_s for r in results if r.external),
        "agent/episode_s": episode.duration_s,
        "agent/generated_tokens": float(episode.num_generated),
        "num_turns": float(len(episode.turns)),
    }


def _sample(
    segment: Segment,
    reward: float,
    truncated: bool,
    metrics: dict[str, float],
    episode: EpisodeRecord,
    keys: GroupKeys,
) -> Sample:
    return Sample(
        prompt_ids=segment.prompt_ids,
        completion_ids=segment.completion_ids,
        completion_logprobs=segment.logprobs,
        completion_mask=segment.mask,
        reward=reward,
        is_truncated=truncated,
        metrics=dict(metrics),
        episode=episode,
        example_id=keys.example_id,
        group_id=keys.group_id,
        policy_step=keys.policy_step,
    )


def _trace_metrics(trace: vf.Trace) -> dict[str, float]:
    metrics = {f"reward/{name}": r.score for name, r in trace.rewards.items() if r is not None}
    metrics.update({name: float(v) for name, v in trace.metrics.items() if v is not None})
    metrics["num_turns"] = float(trace.num_turns)
    return metrics


ENV_INFO_KEYS = ("feedback", "error_turn", "error_kind")
"""Keys an environment may set on ``trace.info`` for SDPO's hint sources (see
``orchestrator/sdpo/sources.py``); they are copied to the ``EpisodeRecord`` as they are."""


def episode_record(trace: vf.Trace, env_label: str) -> EpisodeRecord:
    """The typed record of a verifiers trace (the agent fields are added by ``_agent_samples``)."""
    data = trace.task.data
    return EpisodeRecord(
        env=env_label,
        trace_id=trace.id,
        task_idx=data.idx,
        task_id=data.id,
        task=data.model_dump(mode="json", exclude_defaults=True),
        messages=[message_to_wire(m) for m in trace.messages],
        stop_condition=trace.stop_condition,
        feedback=trace.info.get("feedback"),
        error_turn=trace.info.get("error_turn"),
        error_kind=trace.info.get("error_kind"),
    )


def _describe(errors: Sequence[vf.Error]) -> str | None:
    if not errors:
        return None
    last = errors[-1]
    return f"{last.type}: {last.message}"


def _error_sample(
    error: str,
    env_label: str,
    keys: GroupKeys,
    *,
    prompt_ids: list[int] | None = None,
    episode: EpisodeRecord | None = None,
) -> Sample:
    logger.warning("rollout failed (env %s, group %d): %s", env_label, keys.group_id, error)
    return Sample(
        prompt_ids=prompt_ids or [],
        completion_ids=[],
        completion_logprobs=[],
        completion_mask=[],
        reward=0.0,
        example_id=keys.example_id,
        group_id=keys.group_id,
        policy_step=keys.policy_step,
        error=error,
        episode=episode or EpisodeRecord(env=env_label),
    )

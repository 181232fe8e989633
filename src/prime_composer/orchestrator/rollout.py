"""Run groups of rollouts through verifiers environments and turn them into ``Sample``s.

``RolloutRunner`` holds the loaded environments' serving resources (verifiers' interception
pool, on 127.0.0.1) for as long as it is entered. ``run_group`` plays ``group_size`` episodes of
one task against the inference server at ``base_url`` (OpenAI chat completions), at most
``rollout.max_concurrent`` episodes at a time across all groups, and returns one ``Sample`` per
trainable trace: prompt and completion token ids, sampled logprobs, reward and metrics.

A bad rollout is data, not a crash: a server error, missing token ids or logprobs, a
multi-turn prompt that does not extend the previous turn's tokens, or an exception anywhere in
the environment gives a ``Sample`` with ``error`` set, reward 0 and an empty completion.

Multi-turn: the completion is everything after the first prompt. Turn k's ``prompt_token_ids``
must start with everything before it (first prompt + completions + spliced tokens so far); the
new tokens between (tool results, user turns, template markup) go in with mask 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.env import RunSlot

from prime_composer.config.env import RolloutConfig, SamplingConfig
from prime_composer.orchestrator.envs import LoadedEnv
from prime_composer.orchestrator.harness import TURNS_KEY, TurnRecord
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
    """One Sample per trainable trace of a finished episode (an error Sample if it has none)."""
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    if not traces:
        error = _describe(episode.errors) or "episode produced no trainable trace"
        return [_error_sample(error, env_label, keys)]
    episode_error = _describe(episode.errors)
    return [trace_sample(trace, env_label, keys, episode_error=episode_error) for trace in traces]


def trace_sample(
    trace: vf.Trace,
    env_label: str,
    keys: GroupKeys,
    *,
    episode_error: str | None = None,
) -> Sample:
    """A Sample from one trace: its token records, reward and metrics, or an error Sample."""
    turns: list[TurnRecord] = trace.info.get(TURNS_KEY, [])
    info = _trace_info(trace, env_label)
    error = episode_error or (None if trace.ok else _describe(trace.errors) or "rollout failed")
    if error is None and not turns:
        error = f"the rollout made no model call (stop: {trace.stop_condition})"
    if error is None:
        try:
            prompt_ids, completion_ids, logprobs, mask = assemble_tokens(turns)
        except TokenError as e:
            error = str(e)
    if error is not None:
        prompt = (turns[0]["prompt_token_ids"] if turns else None) or []
        return _error_sample(error, env_label, keys, prompt_ids=list(prompt), info=info)
    return Sample(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completion_logprobs=logprobs,
        completion_mask=mask,
        reward=trace.reward,
        is_truncated=turns[-1]["finish_reason"] == "length" or trace.is_truncated,
        metrics=_trace_metrics(trace),
        info=info,
        example_id=keys.example_id,
        group_id=keys.group_id,
        policy_step=keys.policy_step,
    )


def assemble_tokens(turns: Sequence[TurnRecord]) -> tuple[list[int], list[int], list[float], list[int]]:
    """(prompt ids, completion ids, completion logprobs, completion mask) of a rollout's calls."""
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
    prompt_ids = list(turns[0]["prompt_token_ids"] or [])
    completion_ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for k, turn in enumerate(turns):
        if k > 0:
            context = prompt_ids + completion_ids
            next_prompt = turn["prompt_token_ids"] or []
            if next_prompt[: len(context)] != context:
                raise TokenError(
                    f"turn {k}: its prompt tokens do not extend the previous turns' tokens (the chat "
                    "template re-tokenized earlier text differently); multi-turn training needs prefix-"
                    "consistent rendering"
                )
            spliced = next_prompt[len(context) :]
            completion_ids += spliced
            logprobs += [0.0] * len(spliced)
            mask += [0] * len(spliced)
        completion_ids += turn["completion_token_ids"] or []
        logprobs += turn["completion_logprobs"] or []
        mask += [1] * len(turn["completion_token_ids"] or [])
    return prompt_ids, completion_ids, logprobs, mask


def _trace_metrics(trace: vf.Trace) -> dict[str, float]:
    metrics = {f"reward/{name}": r.score for name, r in trace.rewards.items() if r is not None}
    metrics.update({name: float(v) for name, v in trace.metrics.items() if v is not None})
    metrics["num_turns"] = float(trace.num_turns)
    return metrics


ENV_INFO_KEYS = ("feedback", "error_turn", "error_kind")
"""Keys an environment may set on ``trace.info`` for SDPO's hint sources (see
``orchestrator/sdpo/sources.py``); they are copied to ``Sample.info`` as they are."""


def _trace_info(trace: vf.Trace, env_label: str) -> dict[str, Any]:
    data = trace.task.data
    from_env = {key: trace.info[key] for key in ENV_INFO_KEYS if key in trace.info}
    return {
        **from_env,
        "env": env_label,
        "trace_id": trace.id,
        "task_idx": data.idx,
        "task_id": data.id,
        "task": data.model_dump(mode="json", exclude_defaults=True),
        "messages": [message_to_wire(m) for m in trace.messages],
        "stop_condition": trace.stop_condition,
    }


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
    info: dict[str, Any] | None = None,
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
        info=info or {"env": env_label},
    )

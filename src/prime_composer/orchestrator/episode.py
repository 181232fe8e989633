"""The multi-turn agent loop: sample a reply, run its tool calls in the sandbox, repeat.

``run_episode`` plays one episode against a ``Policy`` (token ids in, token ids and logprobs out:
the inference server's ``/inference/v1/generate``, or a scripted stand-in in tests)::

    messages = task prompt
    loop:
        prompt = ChatRenderer.next_prompt(context, messages, tools)   # extends the context, or
                                                                       # starts a new sample
        reply  = policy.generate(prompt)                               # token-in, token-out
        parse the reply's text into tool calls (prime_composer.tool_calls)
        no call and nothing malformed          -> the model is done   (stop "final_answer")
        each call -> Toolset.call_async -> a ``tool`` message          (errors are results too)
        calls that do not parse -> a ``user`` message saying so, and the loop goes on

until the model is done or a budget of ``AgentLoopConfig`` runs out (turns, context tokens,
sampled tokens, wall time). An episode played against an external environment (``Environment``:
OpenEnv, ``openenv_env.py``) also ends when the environment says it is done, and a reply without a
tool call is that environment's action: its observation comes back as a ``user`` turn. Nothing the model writes can end the run with an exception: a bad
call is a tool result the model sees. Only a failed model call (the server is down, say) raises,
``ModelCallError``, which makes the episode an error sample.

What the episode keeps (``AgentEpisode``): the conversation as rendered, the tools offered, and
one ``AgentTurn`` per model call with its tokens (``new_segment`` and ``prompt_ids``: the whole
prompt when the turn starts a new sample, else only the tokens added since the previous reply),
logprobs, parsed tool calls, tool results with exit codes, and timing. The rollout stage turns
that into Samples (``rollout.py``), SDPO into targets, the trace export into replay traces. The
episode object is filled in as it runs, so a loop cancelled by the rollout's hard timeout still
leaves the turns it finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from prime_composer.config.env import AgentLoopConfig
from prime_composer.orchestrator.chat_render import ChatRenderer
from prime_composer.tool_calls import ToolCall, ToolCallParser

MALFORMED_SNIPPET_CHARS = 200
"""How much of an unparsable tool call the error message quotes back to the model."""

WORKSPACE_CHANGING_TOOLS = frozenset({"edit_file", "write_file", "run"})
"""Tools whose successful call may change the workspace (what a failing test run blames)."""

BUDGET_STOPS = frozenset({"max_turns", "context_limit", "token_budget", "time_limit", "truncated"})
"""Endings that cut the episode short (its samples are marked truncated)."""


class ModelCallError(RuntimeError):
    """A model call failed for a reason that is not the policy's (server error, bad answer)."""


class EnvironmentFailure(RuntimeError):
    """An external environment (``Environment``) could not be reached or broke its protocol: not
    the policy's fault, so the episode becomes an error sample."""


@dataclass(frozen=True)
class Generation:
    """What the policy sampled for one prompt."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token under the sampling distribution (after temperature)."""
    finish_reason: str | None
    """``stop`` (end-of-turn token or stop string), ``length`` (hit ``max_tokens``), ..."""


class Policy(Protocol):
    """Samples a reply to a prompt given as token ids."""

    async def generate(self, prompt_ids: list[int], max_tokens: int, turn: int) -> Generation: ...


class Tools(Protocol):
    """What the loop needs of a toolset (``prime_composer.sandbox.Toolset`` is one)."""

    def definitions(self) -> list[dict[str, Any]]: ...

    async def call_async(self, name: str, arguments: str | dict[str, Any] | None) -> Any: ...


class Environment(Protocol):
    """An environment that plays the other side of the conversation (``openenv_env.py``).

    ``act(text)`` takes a reply that called no tool as an action and returns the observation the
    model sees next (a ``user`` turn), or ``None`` when such a reply ends the episode (an
    environment whose actions are tool calls). ``done`` turns true once the environment ends the
    episode, after an ``act`` or a tool call. Errors of a bad action are observations too; only an
    environment that cannot be reached raises ``EnvironmentFailure`` (the episode becomes an error
    sample).
    """

    @property
    def done(self) -> bool: ...

    async def act(self, text: str) -> str | None: ...


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call as it ran: what the model saw and what the sandbox recorded."""

    call_id: str
    name: str
    arguments: str
    content: str
    """The tool message the model got back."""
    ok: bool
    error: str | None = None
    """Kind of failure (``ToolCallRecord.error``: ``invalid_json``, ``edit_no_match``, ``timeout``,
    ``too_many_calls``, ``time_limit``, ...); a command that ran and exited non-zero is ok."""
    exit_code: int | None = None
    """Exit status of the command the tool ran (``run``, ``run_tests``, ``search``), if it ran one."""
    duration_s: float = 0.0
    external: bool = False
    """An external tool's call (an MCP server's: ``ToolCallRecord.external``)."""

    @property
    def nonzero_exit(self) -> bool:
        return self.exit_code is not None and self.exit_code != 0


@dataclass
class AgentTurn:
    """One model call of an episode."""

    index: int
    new_segment: bool
    """This turn's prompt does not extend the previous turn's tokens: it starts a new sample."""
    prompt_ids: list[int]
    """The whole prompt if ``new_segment``, else only the tokens added after the previous reply."""
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str
    """The reply's text (the assistant message), without the end-of-turn token."""
    message_index: int
    """Position of this turn's assistant message in ``AgentEpisode.messages``."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    """Texts that looked like tool calls but did not parse."""
    tool_results: list[ToolOutcome] = field(default_factory=list)
    started_s: float = 0.0
    """When the model call started, in seconds since the episode started."""
    model_s: float = 0.0
    """Time of the model call."""
    tools_s: float = 0.0
    """Time of this turn's tool calls."""


@dataclass(frozen=True)
class TurnInfo:
    """One assistant turn of a Sample (``Sample.episode.turns``): where its tokens are and what it
    did. Its tokens are ``completion_ids[span[0]:span[1]]`` and its logprobs the same slice of
    ``completion_logprobs``; SDPO targets a turn by its span, the trace export rebuilds the
    episode's steps from these records."""

    index: int
    """Turn number in the episode (0-based); a sample of a split episode starts past 0."""
    span: tuple[int, int]
    message_index: int | None
    """Its assistant message in ``Sample.episode.messages`` (None when the trace has no messages)."""
    finish_reason: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    tool_results: list[ToolOutcome] = field(default_factory=list)
    started_s: float = 0.0
    model_s: float = 0.0
    tools_s: float = 0.0

    @classmethod
    def of(cls, turn: AgentTurn, span: tuple[int, int]) -> TurnInfo:
        return cls(
            index=turn.index,
            span=span,
            message_index=turn.message_index,
            finish_reason=turn.finish_reason,
            tool_calls=list(turn.tool_calls),
            malformed=list(turn.malformed),
            tool_results=list(turn.tool_results),
            started_s=turn.started_s,
            model_s=turn.model_s,
            tools_s=turn.tools_s,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tool calls in OpenAI's shape)."""
        return {
            **{k: v for k, v in asdict(self).items() if k not in ("tool_calls", "span")},
            "span": list(self.span),
            "tool_calls": [call.to_openai() for call in self.tool_calls],
        }


@dataclass
class AgentEpisode:
    """Everything one episode did (see the module docstring)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    """Tool definitions offered (OpenAI format), also the ones rendered when ``render_tools``."""
    rendered_tools: bool
    tool_call_format: str
    """The parser that read tool calls out of the replies (``AgentLoopConfig.tool_call_format``)."""
    turns: list[AgentTurn] = field(default_factory=list)
    stop: str | None = None
    """Why the loop ended: ``final_answer``, or a budget in ``BUDGET_STOPS``; ``None`` while running
    (or when it was cancelled)."""
    duration_s: float = 0.0

    @property
    def num_generated(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)


async def run_episode(
    policy: Policy,
    renderer: ChatRenderer,
    parser: ToolCallParser,
    messages: Sequence[dict[str, Any]],
    tools: Tools | None,
    config: AgentLoopConfig,
    *,
    max_reply_tokens: int,
    max_context_tokens: int | None = None,
    episode: AgentEpisode | None = None,
    clock: Callable[[], float] = time.monotonic,
    environment: Environment | None = None,
) -> AgentEpisode:
    """Play one episode from ``messages`` (the task's prompt); see the module docstring.

    ``max_reply_tokens`` caps each reply (the sampling config's ``max_tokens``);
    ``max_context_tokens`` is the smaller of ``config.max_context_tokens`` and the server's limit.
    Pass ``episode`` (a fresh ``new_episode``) to keep a handle on the record while it runs, and
    ``environment`` for an episode against an external environment (stop ``env_done``).
    """
    definitions = tools.definitions() if tools is not None else []
    if episode is None:
        episode = new_episode(messages, definitions, config)
    rendered = definitions if config.render_tools else None
    started = clock()
    context: list[int] | None = None
    for index in range(config.max_turns):
        if clock() - started >= config.time_limit_s:
            episode.stop = "time_limit"
            break
        prompt, new_segment = renderer.next_prompt(context, episode.messages, rendered)
        room = max_reply_tokens if max_context_tokens is None else max_context_tokens - len(prompt)
        if config.max_episode_tokens is not None:
            room = min(room, config.max_episode_tokens - episode.num_generated)
        if room < 1:
            episode.stop = "token_budget" if _out_of_tokens(episode, config) else "context_limit"
            break
        turn_started = clock()
        generation = await policy.generate(prompt, min(room, max_reply_tokens), index)
        text = renderer.reply_text(generation.token_ids, generation.finish_reason)
        turn = AgentTurn(
            index=index,
            new_segment=new_segment,
            prompt_ids=prompt if context is None or new_segment else prompt[len(context) :],
            completion_ids=generation.token_ids,
            logprobs=generation.logprobs,
            finish_reason=generation.finish_reason,
            text=text,
            message_index=len(episode.messages),
            started_s=turn_started - started,
            model_s=clock() - turn_started,
        )
        episode.turns.append(turn)
        context = [*prompt, *generation.token_ids]
        tools_started = clock()
        acted = await respond(
            episode.messages, text, parser, tools, config, deadline=started + config.time_limit_s, clock=clock
        )
        turn.tool_calls, turn.malformed, turn.tool_results = acted.tool_calls, acted.malformed, acted.results
        observed = False
        if environment is not None and acted.done and not environment.done:
            observation = await environment.act(text)
            if observation is not None and not environment.done:  # the last one no model reads
                episode.messages.append({"role": "user", "content": observation})
                observed = True
        turn.tools_s = clock() - tools_started
        if environment is not None and environment.done:
            episode.stop = "env_done"
            break
        if acted.done and not observed:
            episode.stop = "truncated" if generation.finish_reason == "length" else "final_answer"
            break
    else:
        episode.stop = "max_turns"
    episode.duration_s = clock() - started
    return episode


@dataclass
class Acted:
    """What one reply asked for and what it got."""

    tool_calls: list[ToolCall]
    malformed: list[str]
    results: list[ToolOutcome]

    @property
    def done(self) -> bool:
        """The reply asked for nothing: the model has finished."""
        return not self.tool_calls and not self.malformed


async def respond(
    messages: list[dict[str, Any]],
    text: str,
    parser: ToolCallParser,
    tools: Tools | None,
    config: AgentLoopConfig,
    *,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
) -> Acted:
    """Append the reply ``text`` to ``messages`` and act on it: parse its tool calls, run them (a
    ``tool`` message each, in order), and say what did not parse (one ``user`` message).

    The training loop and the SFT reference playback (``sft_play.py``) both build conversations
    with this, so warm-up data and episodes look alike to the model.
    """
    parsed = parser.parse(text)
    acted = Acted(list(parsed.tool_calls), list(parsed.malformed), [])
    messages.append({"role": "assistant", "content": text})
    for call_index, call in enumerate(acted.tool_calls):
        outcome = await _run_call(tools, call, call_index, config, time_left=deadline - clock())
        acted.results.append(outcome)
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": outcome.content}
        )
    if acted.malformed:
        messages.append({"role": "user", "content": malformed_message(acted.malformed)})
    return acted


def new_episode(
    messages: Sequence[dict[str, Any]], definitions: list[dict[str, Any]], config: AgentLoopConfig
) -> AgentEpisode:
    """An empty episode record that ``run_episode`` fills in."""
    return AgentEpisode(
        messages=[dict(m) for m in messages],
        tools=definitions,
        rendered_tools=config.render_tools,
        tool_call_format=config.tool_call_format,
    )


def malformed_message(malformed: Sequence[str]) -> str:
    """What the model is told about tool calls in its reply that did not parse."""
    snippet = malformed[0]
    if len(snippet) > MALFORMED_SNIPPET_CHARS:
        snippet = snippet[:MALFORMED_SNIPPET_CHARS] + "..."
    count = "1 tool call" if len(malformed) == 1 else f"{len(malformed)} tool calls"
    return (
        f"Error: {count} in your reply could not be parsed, so nothing was run: {snippet}\n"
        'A call must be a JSON object with a "name" and an "arguments" object.'
    )


async def _run_call(
    tools: Tools | None, call: ToolCall, call_index: int, config: AgentLoopConfig, *, time_left: float
) -> ToolOutcome:
    def refused(error: str, content: str) -> ToolOutcome:
        return ToolOutcome(call.id, call.name, call.arguments, content, ok=False, error=error)

    if tools is None:
        return refused(
            "unknown_tool", f"Error: there is no tool named {call.name!r}: this task has no tools."
        )
    if call_index >= config.max_tool_calls_per_turn:
        return refused(
            "too_many_calls",
            f"Error: at most {config.max_tool_calls_per_turn} tool calls run per reply; this one was not run.",
        )
    if time_left <= 0:
        return refused("time_limit", "Error: the episode's time limit is reached; this call was not run.")
    result = await tools.call_async(call.name, call.arguments)
    record = result.record
    run = record.run or {}
    return ToolOutcome(
        call_id=call.id,
        name=call.name,
        arguments=call.arguments,
        content=result.content,
        ok=record.ok,
        error=record.error,
        exit_code=run.get("exit_code"),
        duration_s=record.duration_s,
        external=record.external,
    )


def _out_of_tokens(episode: AgentEpisode, config: AgentLoopConfig) -> bool:
    return config.max_episode_tokens is not None and episode.num_generated >= config.max_episode_tokens


def localize_error(episode: AgentEpisode) -> tuple[int, str, str] | None:
    """``(turn index, error kind, feedback text)`` of the turn an episode's error points to.

    - the first turn whose reply had a tool call that did not parse, a call that failed (an error
      result: unknown tool, bad arguments, no match for an edit, a timeout, ...) or a ``run``
      command that exited non-zero: kind ``tool_error``, the tool's answer as feedback;
    - else, when the episode's last test run failed (``run_tests`` exited non-zero), the last turn
      before it that changed the workspace (``edit_file``, ``write_file``, ``run``): that change
      did not fix the code; or the test run's own turn when nothing was changed before it. Kind
      ``failing_test``, the test output as feedback. (A failing run before any fix is how a coding
      episode starts: only the last run says what was still broken when the model stopped.)
    - else None (environment feedback, if any, decides).
    """
    for turn in episode.turns:
        if turn.malformed:
            return turn.index, "tool_error", malformed_message(turn.malformed)
        for outcome in turn.tool_results:
            if not outcome.ok or (outcome.name == "run" and outcome.nonzero_exit):
                return turn.index, "tool_error", outcome.content
    runs = [
        (turn.index, r) for turn in episode.turns for r in turn.tool_results if r.name == "run_tests" and r.ok
    ]
    if not runs or not runs[-1][1].nonzero_exit:
        return None
    run_turn, run = runs[-1]
    changes = [
        turn.index
        for turn in episode.turns[:run_turn]
        if any(r.ok and r.name in WORKSPACE_CHANGING_TOOLS for r in turn.tool_results)
    ]
    return (changes[-1] if changes else run_turn), "failing_test", run.content

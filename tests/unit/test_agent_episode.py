"""The agent loop with a scripted policy and in-memory tools: token-exact prompts, masks, tool
results, malformed calls, every budget, template rewrites that split an episode, and where an
error is localized. Expected tokens are rendered here from hand-written message lists with the
tiny model's tokenizer, not read back from the loop."""

from __future__ import annotations

import asyncio
import json
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
from transformers import AutoTokenizer

from prime_composer.config.env import AgentLoopConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.chat_render import ChatRenderer, splice_prompt
from prime_composer.orchestrator.episode import AgentEpisode, Generation, localize_error, run_episode
from prime_composer.orchestrator.rollout import _error_targets, assemble_segments
from prime_composer.sandbox.tools import ToolCallRecord, ToolResult
from prime_composer.tool_calls import get_parser

PROMPT = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Fix calc.py."}]


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Script:
    """A policy that answers ``replies`` in order; ``pieces`` samples each character as its own
    token (a tokenization the tokenizer itself would never produce)."""

    def __init__(self, tok: Any, replies: list[str], *, pieces: bool = False) -> None:
        self.tok, self.replies, self.pieces = tok, replies, pieces
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], max_tokens: int, turn: int) -> Generation:
        self.prompts.append(list(prompt_ids))
        text = self.replies[min(turn, len(self.replies) - 1)]
        if self.pieces:
            ids = [i for ch in text for i in self.tok.encode(ch, add_special_tokens=False)]
        else:
            ids = self.tok.encode(text, add_special_tokens=False)
        ids.append(self.tok.eos_token_id)
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        return Generation(ids, [-0.5 - 0.01 * j for j in range(len(ids))], finish)


class FakeTools:
    """Tools that answer from a table; ``run_tests`` fails until ``edit_file`` ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fixed = False

    def definitions(self) -> list[dict[str, Any]]:
        return [
            {"type": "function", "function": {"name": n, "parameters": {}}}
            for n in ("run_tests", "edit_file")
        ]

    async def call_async(self, name: str, arguments: str) -> ToolResult:
        self.calls.append((name, arguments))
        if name == "edit_file":
            args = json.loads(arguments)
            if args.get("old_string") != "a - b":
                return _result(name, arguments, "Error: old_string was not found", error="edit_no_match")
            self.fixed = True
            return _result(name, arguments, "Edited calc.py.")
        if name == "run_tests":
            code = 0 if self.fixed else 1
            return _result(name, arguments, f"Exit code: {code}", exit_code=code)
        return _result(name, arguments, f"Error: there is no tool named {name!r}", error="unknown_tool")


def _result(
    name: str, arguments: str, content: str, *, error: str | None = None, exit_code: int | None = None
) -> ToolResult:
    run = None if exit_code is None else {"exit_code": exit_code}
    return ToolResult(
        content, ToolCallRecord(name=name, arguments=arguments, ok=error is None, error=error, run=run)
    )


def play(
    tok: Any,
    replies: list[str],
    *,
    tools: FakeTools | None = None,
    renderer: ChatRenderer | None = None,
    pieces: bool = False,
    max_reply_tokens: int = 200,
    max_context_tokens: int | None = None,
    clock: Callable[[], float] | None = None,
    **config: Any,
) -> tuple[AgentEpisode, Script, FakeTools]:
    tools = tools or FakeTools()
    script = Script(tok, replies, pieces=pieces)
    kwargs: dict[str, Any] = {"clock": clock} if clock else {}
    episode = asyncio.run(
        run_episode(
            script,
            renderer or ChatRenderer(tok),
            get_parser("hermes"),
            PROMPT,
            tools,
            AgentLoopConfig(**config),
            max_reply_tokens=max_reply_tokens,
            max_context_tokens=max_context_tokens,
            **kwargs,
        )
    )
    return episode, script, tools


def render_ids(tok: Any, messages: list[dict[str, Any]], gen: bool = True) -> list[int]:
    """The template's rendering with FakeTools' definitions (the tiny template renders tools)."""
    text = tok.apply_chat_template(
        messages, tools=FakeTools().definitions(), tokenize=False, add_generation_prompt=gen
    )
    return tok.encode(text, add_special_tokens=False)


ORACLE = [
    call("run_tests"),
    call("edit_file", old_string="a - b", new_string="a + b"),
    call("run_tests"),
    "Done.",
]


def test_an_episode_runs_its_tool_calls_and_stops_at_the_final_answer(tok) -> None:
    episode, script, tools = play(tok, ORACLE)
    assert episode.stop == "final_answer" and len(episode.turns) == 4
    assert [name for name, _ in tools.calls] == ["run_tests", "edit_file", "run_tests"]
    assert [r.exit_code for t in episode.turns for r in t.tool_results] == [1, None, 0]
    roles = [m["role"] for m in episode.messages]
    assert roles == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert episode.messages[3]["content"] == "Exit code: 1"
    assert episode.messages[3]["tool_call_id"] == episode.turns[0].tool_calls[0].id
    # Every prompt is the template's rendering of the conversation so far: the model saw exactly it.
    for k, prompt in enumerate(script.prompts):
        before = episode.turns[k].message_index
        assert prompt == render_ids(tok, episode.messages[:before])
        assert episode.messages[before] == {"role": "assistant", "content": ORACLE[k]}


def test_one_sample_with_policy_tokens_masked_in_and_the_rest_out(tok) -> None:
    episode, _, _ = play(tok, ORACLE)
    (segment,) = assemble_segments(episode.turns)
    assert segment.prompt_ids == render_ids(tok, PROMPT)
    full = render_ids(tok, episode.messages, gen=False)
    # The sample is the whole conversation; the template's newline after the last <|im_end|> is not generated.
    assert segment.prompt_ids + segment.completion_ids == full[:-1]
    expected_mask: list[int] = []
    for k, turn in enumerate(episode.turns):
        before = render_ids(tok, episode.messages[: turn.message_index])
        reply = [*tok.encode(ORACLE[k], add_special_tokens=False), tok.eos_token_id]
        expected_mask += [0] * (len(before) - len(segment.prompt_ids) - len(expected_mask)) + [1] * len(reply)
        start, end = segment.spans[k]
        assert segment.completion_ids[start:end] == reply
        assert segment.logprobs[start:end] == pytest.approx([-0.5 - 0.01 * j for j in range(len(reply))])
    assert segment.mask == expected_mask
    assert all(lp == 0.0 for lp, m in zip(segment.logprobs, segment.mask, strict=True) if not m)


def test_sampled_tokens_are_kept_as_sampled_not_re_encoded(tok) -> None:
    episode, script, _ = play(tok, ORACLE, pieces=True)
    assert not any(t.new_segment for t in episode.turns[1:])  # still one sample
    for k in range(1, len(script.prompts)):
        previous = script.prompts[k - 1] + episode.turns[k - 1].completion_ids
        assert script.prompts[k][: len(previous)] == previous
    # ... although the tokenizer would write those replies differently.
    assert render_ids(tok, episode.messages[: episode.turns[1].message_index]) != script.prompts[1]


def test_malformed_calls_are_reported_to_the_model_and_the_episode_goes_on(tok) -> None:
    broken = '<tool_call>{"name": "edit_file", "arguments": {"old_string": }</tool_call>'
    episode, _, tools = play(tok, [broken, call("run_tests"), "Done."])
    assert episode.stop == "final_answer" and len(episode.turns) == 3
    assert episode.turns[0].malformed == [broken] and not episode.turns[0].tool_calls
    error = episode.messages[episode.turns[0].message_index + 1]
    assert (
        error["role"] == "user" and "could not be parsed" in error["content"] and broken in error["content"]
    )
    assert tools.calls == [("run_tests", "{}")]
    assert localize_error(episode) == (0, "tool_error", error["content"])


def test_every_budget_ends_the_episode(tok) -> None:
    loop = [call("run_tests")]
    assert play(tok, loop, max_turns=3)[0].stop == "max_turns"
    episode, _, _ = play(tok, loop, max_turns=3, max_episode_tokens=40)
    assert episode.stop == "token_budget" and episode.num_generated == 40
    long_prompt = len(render_ids(tok, PROMPT))
    episode, _, _ = play(tok, loop, max_context_tokens=long_prompt + 30)
    assert episode.stop == "context_limit"
    assert all(len(t.prompt_ids) <= long_prompt + 30 for t in episode.turns)
    ticks = iter(range(1000))
    episode, _, _ = play(tok, loop, time_limit_s=3.5, clock=lambda: float(next(ticks)))
    assert episode.stop == "time_limit" and len(episode.turns) >= 1
    # A reply cut by max_tokens with no call in it ends the episode as truncated.
    assert play(tok, ["x" * 300], max_reply_tokens=20)[0].stop == "truncated"


def test_calls_beyond_the_per_turn_cap_are_not_run(tok) -> None:
    episode, _, tools = play(tok, [call("run_tests") * 3, "Done."], max_tool_calls_per_turn=2)
    assert len(tools.calls) == 2
    assert [r.error for r in episode.turns[0].tool_results] == [None, None, "too_many_calls"]


def test_a_template_that_rewrites_history_starts_a_new_sample(tok) -> None:
    # This template shows only the last assistant reply in full (like templates that drop earlier
    # reasoning): after the second reply, the first one's text changes.
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last and loop.index < 5 %}"
        "{{ '<|im_start|>assistant\\n[earlier reply]<|im_end|>\\n' }}{% else %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    renderer = ChatRenderer(tok, {"chat_template": template})
    episode, script, _ = play(tok, ORACLE, renderer=renderer)
    assert [t.new_segment for t in episode.turns] == [True, True, False, False]
    segments = assemble_segments(episode.turns)
    assert [s.turns for s in segments] == [[0], [1, 2, 3]]
    assert segments[1].prompt_ids == script.prompts[1]  # the rewritten conversation, in full
    assert "[earlier reply]" in tok.decode(segments[1].prompt_ids)
    assert segments[0].completion_ids == episode.turns[0].completion_ids  # turn 0 is kept as sampled


def test_localize_error_blames_the_change_a_failing_last_test_run_points_to(tok) -> None:
    wrong = call("edit_file", old_string="a - b", new_string="0")

    class NeverFixed(FakeTools):
        async def call_async(self, name: str, arguments: str) -> ToolResult:
            result = await super().call_async(name, arguments)
            self.fixed = False
            return result

    episode, _, _ = play(tok, [call("run_tests"), wrong, call("run_tests"), "Done."], tools=NeverFixed())
    turn, kind, text = localize_error(episode)  # type: ignore[misc]
    assert (turn, kind, text) == (1, "failing_test", "Exit code: 1")
    # A passing last run: nothing to blame. A failing run with no change before it: the run itself.
    assert localize_error(play(tok, ORACLE)[0]) is None
    assert localize_error(play(tok, [call("run_tests"), "Done."])[0])[:2] == (0, "failing_test")  # type: ignore[index]
    bad_edit = play(tok, [call("edit_file", old_string="nope", new_string="x"), "Done."])[0]
    assert localize_error(bad_edit)[:2] == (0, "tool_error")  # type: ignore[index]


def test_splice_prompt_keeps_the_student_tokens_of_the_shared_history(tok) -> None:
    renderer = ChatRenderer(tok)
    messages = [*PROMPT, {"role": "assistant", "content": "abc"}, {"role": "tool", "content": "ok"}]
    student_text = renderer.text(messages)
    # A non-canonical encoding of the same text: special tokens as themselves, every other
    # character as its own token(s).
    student: list[int] = []
    for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", student_text):
        if part in ("<|im_start|>", "<|im_end|>"):
            student.append(tok.convert_tokens_to_ids(part))
        else:
            student += [i for ch in part for i in tok.encode(ch, add_special_tokens=False)]
    assert tok.decode(student) == student_text and student != renderer.encode(student_text)
    teacher_text = renderer.text([*messages, {"role": "user", "content": "Hint: look at line 2."}])
    spliced = splice_prompt(renderer, student, student_text, teacher_text)
    assert tok.decode(spliced) == teacher_text
    shared = next(i for i, (a, b) in enumerate(zip(student_text, teacher_text, strict=False)) if a != b)
    kept = max(k for k in range(len(student) + 1) if len(tok.decode(student[:k])) <= shared)
    assert spliced[:kept] == student[:kept]
    assert spliced[kept:] == renderer.encode(teacher_text[len(tok.decode(student[:kept])) :])


def test_error_targets_follow_the_turns_into_the_samples_of_a_split_episode(tok) -> None:
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.index < 4 and not loop.last %}"
        "{{ '<|im_start|>assistant\\n[earlier]<|im_end|>\\n' }}{% else %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    replies = [call("run_tests"), call("edit_file", old_string="nope", new_string="x"), "Done."]
    episode, _, _ = play(tok, replies, renderer=ChatRenderer(tok, {"chat_template": template}))
    segments = assemble_segments(episode.turns)
    assert [s.turns for s in segments] == [[0], [1, 2]]

    def targets(**info: Any) -> list[dict[str, Any]]:
        return _error_targets(types.SimpleNamespace(info=info), episode, segments)  # type: ignore[arg-type]

    # The failed edit of episode turn 1 is turn 0 of the second sample; environment feedback
    # without a turn is about the last turn (turn 1 there).
    first, second = targets(feedback="tests still fail")
    assert first == {}
    assert second["error_turn"] == 0
    assert second["feedback"] == [
        {"text": "tests still fail", "turn": 1},
        {"text": "Error: old_string was not found", "turn": 0, "kind": "tool_error"},
    ]
    # An explicit error turn wins over the harness's and lands in its own sample.
    first, second = targets(error_turn=0, feedback={"text": "wrong start", "turn": 0}, error_kind="x")
    assert first == {"error_turn": 0, "feedback": [{"text": "wrong start", "turn": 0}], "error_kind": "x"}
    assert second == {"error_kind": "x"}
    # Bad values reach the hint builder unchanged, which counts them.
    assert targets(error_turn=9, feedback=42)[1] == {"error_turn": 9, "feedback": [42]}

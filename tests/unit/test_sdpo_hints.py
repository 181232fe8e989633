"""SDPO hint building: targets, hint sources, teacher rendering, truncation (tiny tokenizer).

Rollouts are made the way the rollout stage makes them: the prompt rendered by the chat template,
each assistant turn's tokens, and the environment's tokens spliced in between with mask 0. Expected
teacher contexts are rendered independently from hand-written message lists.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from transformers import AutoTokenizer

from prime_composer.config.sdpo import HintConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.render import assistant_turns, fit_teacher
from prime_composer.orchestrator.sdpo.target import sdpo_target

HINTS_DIR = Path(__file__).resolve().parents[2] / "hints"
SYSTEM = {"role": "system", "content": "You are a helpful assistant"}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))


def render(tok, messages, gen=True) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def reply_ids(tok, text: str) -> list[int]:
    return [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]


def rollout(tok, messages, *, reward, group_id=0, info=None, **kw) -> Sample:
    """A Sample from a full chat: the prompt is everything before the first assistant message."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = render(tok, messages[:first])
    completion: list[int] = []
    mask: list[int] = []
    for i in range(first, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        context = render(tok, messages[:i])
        spliced = context[len(prompt) + len(completion) :]
        assert context[: len(prompt) + len(completion)] == prompt + completion
        ids = reply_ids(tok, messages[i]["content"])
        completion += spliced + ids
        mask += [0] * len(spliced) + [1] * len(ids)
    return Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[0.0] * len(completion),
        completion_mask=mask,
        reward=reward,
        example_id=group_id,
        group_id=group_id,
        policy_step=0,
        episode=EpisodeRecord(
            messages=messages,
            task={"prompt": messages[1]["content"], "answer": "7"},
            **(info or {}),
        ),
        **kw,
    )


def single(tok, answer: str, reward: float, group_id: int = 0, **kw) -> Sample:
    msgs = [SYSTEM, {"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": answer}]
    return rollout(tok, msgs, reward=reward, group_id=group_id, **kw)


def build(tok, samples, seq_len=512, **cfg):
    cfg.setdefault("template_dir", HINTS_DIR)
    builder = HintBuilder(HintConfig(enabled=True, **cfg), tok, seq_len)
    return asyncio.run(builder.apply(samples))


def teacher_text(tok, s: Sample) -> str:
    start, end = sdpo_target(s).span
    return tok.decode(sdpo_target(s).teacher_prefix_ids + s.completion_ids[start:end])


def test_assistant_turns():
    assert assistant_turns([1, 1, 0, 0, 1, 0, 1]) == [(0, 2), (4, 5), (6, 7)]
    assert assistant_turns([0, 0]) == [] and assistant_turns([]) == []


def test_targets_lowest_reward_first_capped_by_fraction(tok):
    group = [single(tok, "7", 1.0), single(tok, "8", 0.0), single(tok, "9", 0.5), single(tok, "6", 0.0)]
    stats = build(tok, group, sources=["template"], max_hinted_fraction=0.5)
    assert [sdpo_target(s) is not None for s in group] == [False, True, False, True]
    assert stats.num_candidates == 3 and stats.num_hinted == 2
    m = stats.metrics(["template"])
    assert m["sdpo/hinted_fraction"] == 0.5 and m["sdpo/source/template"] == 2
    assert m["sdpo/skipped/over_fraction"] == 1
    # Single turn: the span is the whole completion.
    assert sdpo_target(group[1]).span == (0, len(group[1].completion_ids))


def test_sibling_hint_uses_a_successful_sibling_of_the_same_group_only(tok):
    good = single(tok, "7", 1.0, group_id=0)
    bad = single(tok, "8", 0.0, group_id=0)
    alone = single(tok, "5", 0.0, group_id=1)  # its group has no success
    other_good = single(tok, "123", 1.0, group_id=2)
    stats = build(tok, [good, bad, alone, other_good], sources=["sibling"])
    assert sdpo_target(bad).source == "sibling"
    assert sdpo_target(bad).hint == "Hint: A correct answer to this task was:\n7"
    assert sdpo_target(good) is None and sdpo_target(other_good) is None
    assert sdpo_target(alone) is None and stats.skipped["no_hint"] == 1
    # The hint is a user message right before the reply, rendered with the same template.
    expected = render(
        tok,
        [
            SYSTEM,
            {"role": "user", "content": "What is 3 + 4?"},
            {"role": "user", "content": sdpo_target(bad).hint},
        ],
    )
    assert sdpo_target(bad).teacher_prefix_ids == expected


def test_sibling_never_uses_the_sample_itself(tok):
    # A sample above success_threshold but below reward_threshold is both target and "success".
    a = single(tok, "7", 0.6)
    b = single(tok, "8", 0.6)
    build(tok, [a, b], sources=["sibling"], success_threshold=0.5)
    assert sdpo_target(a).hint.endswith("\n8") and sdpo_target(b).hint.endswith("\n7")


def test_template_hint_by_error_kind(tok):
    wrong = single(tok, "8", 0.0)
    badfmt = single(tok, "eight", 0.0, metrics={"is_integer": 0.0})
    cut = single(tok, "88888", 0.0, is_truncated=True)
    build(tok, [wrong, badfmt, cut], sources=["template"], metric_error_kinds={"is_integer": "wrong_format"})
    assert sdpo_target(wrong).hint == "Hint: The correct answer is 7."
    assert sdpo_target(wrong).template == "wrong_answer"
    assert sdpo_target(badfmt).template == "wrong_format" and "eight" in sdpo_target(badfmt).hint
    assert sdpo_target(cut).template == "truncated"


def test_template_falls_back_to_default_when_a_placeholder_is_unknown(tok, tmp_path):
    (tmp_path / "wrong_answer.txt").write_text("The answer is {answer}, see {missing}.")
    (tmp_path / "default.txt").write_text("Not {reply}.")
    s = single(tok, "8", 0.0)
    build(tok, [s], sources=["template"], template_dir=tmp_path)
    assert sdpo_target(s).hint == "Hint: Not 8." and sdpo_target(s).template == "default"


def test_missing_template_dir_or_default_is_a_config_error(tok, tmp_path):
    with pytest.raises(ValueError, match="template_dir"):
        HintBuilder(HintConfig(template_dir=tmp_path / "nope"), tok, 256)
    with pytest.raises(ValueError, match=r"default\.txt"):
        HintBuilder(HintConfig(template_dir=tmp_path), tok, 256)


def _multi_turn(tok, info=None, reward=0.0, middle_turns=0):
    msgs = [SYSTEM, {"role": "user", "content": "What is 3 + 4? Use the calc tool."}]
    for k in range(middle_turns):
        msgs += [{"role": "assistant", "content": f"think {k}"}, {"role": "user", "content": "continue " * 8}]
    msgs += [
        {"role": "assistant", "content": "calc(3 plus 4)"},
        {"role": "user", "content": "error: bad expression"},
        {"role": "assistant", "content": "8"},
    ]
    return rollout(tok, msgs, reward=reward, info=info), msgs


def test_feedback_hint_goes_before_the_turn_it_is_about(tok):
    feedback = {"turn": 0, "text": "calc wants 3 + 4, not words", "kind": "tool_error"}
    s, msgs = _multi_turn(tok, info={"feedback": [feedback]})
    build(tok, [s], sources=["feedback", "template"])
    turns = assistant_turns(s.completion_mask)
    assert len(turns) == 2 and sdpo_target(s).span == turns[0]
    assert sdpo_target(s).source == "feedback"
    hint = {
        "role": "user",
        "content": "Hint: Feedback on a previous attempt at this step:\ncalc wants 3 + 4, not words",
    }
    assert sdpo_target(s).teacher_prefix_ids == render(tok, [*msgs[:2], hint])
    # Only policy tokens of the target turn: none of the spliced environment tokens.
    assert all(s.completion_mask[sdpo_target(s).span[0] : sdpo_target(s).span[1]])


def test_error_defaults_to_the_last_turn_and_append_placement(tok):
    s, msgs = _multi_turn(tok)
    build(tok, [s], sources=["template"], placement="append", hint_format="[{hint}]")
    assert sdpo_target(s).span == assistant_turns(s.completion_mask)[-1]
    hinted = [dict(m) for m in msgs[:4]]
    hinted[3]["content"] += "\n\n[The correct answer is 7.]"
    assert sdpo_target(s).teacher_prefix_ids == render(tok, hinted)


def test_teacher_sequence_retokenizes_consistently(tok):
    for s in (single(tok, "8", 0.0), _multi_turn(tok)[0]):
        build(tok, [s], sources=["template"])
        start, end = sdpo_target(s).span
        ids = sdpo_target(s).teacher_prefix_ids + s.completion_ids[start:end]
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
        # ... and is the template's rendering of the hinted chat with the same reply.
        hinted_chat = tok.decode(sdpo_target(s).teacher_prefix_ids) + tok.decode(s.completion_ids[start:end])
        assert hinted_chat.endswith("<|im_start|>assistant\n8<|im_end|>")
        assert "Hint: The correct answer is 7.<|im_end|>\n<|im_start|>assistant\n8<|im_end|>" in hinted_chat


def test_render_mismatch_gets_no_hint(tok):
    s = single(tok, "8", 0.0)
    s.episode.messages[0] = {"role": "system", "content": "Another system prompt"}
    stats = build(tok, [s], sources=["template"])
    assert sdpo_target(s) is None and stats.skipped["render_mismatch"] == 1


def test_bad_feedback_and_error_turn_are_counted_not_raised(tok):
    a = single(tok, "8", 0.0, info={"feedback": 42})
    b = single(tok, "8", 0.0, info={"error_turn": 3})
    stats = build(tok, [a, b], sources=["template"])
    assert stats.skipped == {"bad_feedback": 1, "bad_error_turn": 1}


def test_truncation_cuts_the_middle_keeping_task_and_target(tok):
    s, msgs = _multi_turn(tok, middle_turns=6)
    full_prefix = render(tok, [*msgs[:-1], {"role": "user", "content": "Hint: The correct answer is 7."}])
    span_len = len(reply_ids(tok, "8"))
    seq_len = len(s.prompt_ids) + len(s.completion_ids)  # the student fits; the teacher (+hint) does not
    assert len(full_prefix) + span_len > seq_len
    stats = build(tok, [s], seq_len=seq_len, sources=["template"])
    assert stats.num_teacher_truncated == 1
    start, end = sdpo_target(s).span
    teacher = sdpo_target(s).teacher_prefix_ids + s.completion_ids[start:end]
    assert len(teacher) <= seq_len and end - start == span_len
    task = render(tok, msgs[:2], gen=False)
    assert teacher[: len(task)] == task  # the task statement survives, from the first token
    hint_tail = render(tok, [*msgs[:-1], {"role": "user", "content": "Hint: The correct answer is 7."}])
    tail = hint_tail[len(render(tok, msgs[:-1], gen=False)) :]
    assert sdpo_target(s).teacher_prefix_ids[-len(tail) :] == tail  # hint + generation prompt survive
    assert "continue" in tok.decode(
        sdpo_target(s).teacher_prefix_ids[len(task) : -len(tail)]
    )  # recent history kept


def test_fit_teacher_shortens_the_span_when_nothing_else_can_go():
    prefix = [1, 2, 3, 9, 9]  # task [1, 2], shared history [3], tail [9, 9]
    assert fit_teacher(prefix, [1, 2, 3], [1, 2], 4, 9) == (prefix, 4)
    assert fit_teacher(prefix, [1, 2, 3], [1, 2], 4, 8) == ([1, 2, 9, 9], 4)
    assert fit_teacher(prefix, [1, 2, 3], [1, 2], 4, 6) == ([1, 2, 9, 9], 2)
    assert fit_teacher(prefix, [1, 2, 3], [1, 2], 4, 4) is None


def test_max_hint_tokens_cuts_long_hints(tok, tmp_path):
    (tmp_path / "default.txt").write_text("word " * 100)
    s = single(tok, "8", 0.0)
    build(tok, [s], sources=["template"], template_dir=tmp_path, max_hint_tokens=10)
    assert len(tok.encode(sdpo_target(s).hint, add_special_tokens=False)) <= 10


def test_config_errors():
    with pytest.raises(ValueError, match="base_url"):
        HintConfig(sources=["llm"])
    with pytest.raises(ValueError, match=r"not in orchestrator\.sdpo\.sources"):
        HintConfig(llm={"base_url": "http://127.0.0.1:1/v1", "model": "m"})
    with pytest.raises(ValueError, match="hint_format"):
        HintConfig(hint_format="no placeholder")
    with pytest.raises(ValueError, match="twice"):
        HintConfig(sources=["template", "template"])


class _FakeOpenAI(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        if self.path.startswith("/broken"):
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        reply = {"choices": [{"message": {"role": "assistant", "content": " Add the two numbers: 7. "}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_openai():
    _FakeOpenAI.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeOpenAI.bodies
    server.shutdown()
    server.server_close()


def test_llm_hint_from_an_openai_compatible_server(tok, fake_openai, monkeypatch):
    url, bodies = fake_openai
    monkeypatch.setenv("HINT_KEY", "sekrit")
    s = single(tok, "8", 0.0)
    llm = {"base_url": f"{url}/v1", "model": "hinter", "api_key_env": "HINT_KEY"}
    stats = build(tok, [s], sources=["llm", "template"], llm=llm)
    assert sdpo_target(s).source == "llm" and sdpo_target(s).hint == "Hint: Add the two numbers: 7."
    assert stats.num_llm_errors == 0 and stats.metrics(["llm", "template"])["sdpo/source/llm"] == 1
    (body,) = bodies
    assert body["path"] == "/v1/chat/completions" and body["model"] == "hinter"
    assert body["auth"] == "Bearer sekrit"
    user = body["messages"][1]["content"]
    assert "What is 3 + 4?" in user and "went wrong] 8" in user and '"answer": "7"' in user


def test_llm_failure_is_counted_and_the_next_source_is_used(tok, fake_openai):
    url, _ = fake_openai
    s = single(tok, "8", 0.0)
    t = single(tok, "9", 0.0)
    llm = {"base_url": f"{url}/broken/v1", "model": "hinter", "retry": {"max_retries": 1, "backoff_s": 0}}
    stats = build(tok, [s, t], sources=["llm", "template"], llm=llm)
    assert sdpo_target(s).source == "template" and sdpo_target(t).source == "template"
    assert stats.num_llm_errors == 2 and stats.metrics(["llm", "template"])["sdpo/llm_errors"] == 2
    # Nothing listening at all: still no crash.
    u = single(tok, "8", 0.0)
    stats = build(
        tok,
        [u],
        sources=["llm"],
        llm={"base_url": "http://127.0.0.1:9/v1", "model": "m", "retry": {"timeout_s": 2, "max_retries": 0}},
    )
    assert sdpo_target(u) is None and stats.num_llm_errors == 1 and stats.skipped["no_hint"] == 1


def test_missing_api_key_variable_is_a_config_error(tok, monkeypatch):
    monkeypatch.delenv("NOPE_KEY", raising=False)
    cfg = HintConfig(
        sources=["llm"], llm={"base_url": "http://127.0.0.1:9/v1", "model": "m", "api_key_env": "NOPE_KEY"}
    )
    with pytest.raises(ValueError, match="NOPE_KEY"):
        HintBuilder(cfg, tok, 256)

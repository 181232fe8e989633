"""Tool calls on the hf server without a model (inference/tools.py and its use in preprocess.py):
what ``tool_choice`` asks for, how tools and earlier calls reach the chat template, what the tiny
model's template renders, and how a reply is read back.

The tiny template's renderings are compared with hand-written expected text (the Qwen3 layout),
and its plain conversations with the template it had before tools existed, kept here verbatim.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from prime_composer.inference.guard import APIError
from prime_composer.inference.preprocess import Preprocessor
from prime_composer.inference.protocol import ChatCompletionRequest
from prime_composer.inference.tools import (
    NO_TOOLS,
    ToolCallStats,
    plan_tools,
    template_message,
    template_reads_tools,
    template_tools,
)
from prime_composer.model.resolve import resolve_model_name

OLD_TINY_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_tool_choice_plans() -> None:
    assert plan_tools(_request(), "hermes") is NO_TOOLS
    assert plan_tools(_request(tools=[WEATHER], tool_choice="none"), "hermes") is NO_TOOLS
    auto = plan_tools(_request(tools=[WEATHER]), "hermes")  # no tool_choice: auto, as OpenAI
    assert auto.parser is not None and auto.reply_prefix == "" and not auto.single_call
    required = plan_tools(_request(tools=[WEATHER], tool_choice="required"), "hermes")
    assert required.reply_prefix == "<tool_call>\n" and required.function is None
    named = plan_tools(
        _request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        "hermes",
    )
    assert named.function == "get_weather"
    assert named.reply_prefix == '<tool_call>\n{"name": "get_weather", "arguments":'
    assert plan_tools(_request(tools=[WEATHER], parallel_tool_calls=False), "hermes").single_call
    # OpenAI's finish reasons: tool_calls for auto/required calls, stop for a named call, length kept.
    assert auto.finish_reason("stop", 1) == "tool_calls" and auto.finish_reason("stop", 0) == "stop"
    assert auto.finish_reason("length", 2) == "length" and named.finish_reason("stop", 1) == "stop"


@pytest.mark.parametrize(
    ("fields", "parser", "needle"),
    [
        ({"tools": []}, "hermes", "must not be an empty array"),
        ({"tool_choice": "auto"}, "hermes", "tool_choice needs tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "hermes", "is not a tool choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "hermes", "only function tools"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": ""}}}, "hermes", "non-empty string"),
        ({"tools": [WEATHER]}, None, "inference.tool_call_parser = 'none'"),
        ({"tools": [WEATHER], "tool_choice": "required"}, None, "needs a tool-call parser"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            "hermes",
            "cannot continue_final_message",
        ),
    ],
)
def test_tool_choice_refusals(fields: dict[str, Any], parser: str | None, needle: str) -> None:
    with pytest.raises(APIError, match=needle) as info:
        plan_tools(_request(**fields), parser)
    assert info.value.status == 400


def test_without_a_parser_the_reply_to_tools_can_still_be_text() -> None:
    assert plan_tools(_request(tools=[WEATHER], tool_choice="none"), None) is NO_TOOLS


def test_tools_take_vllms_form_and_bad_entries_are_named() -> None:
    tools = [
        {"type": "function", "function": {"name": "a", "extra": 1}},
        {"function": {"name": "b", "description": "B", "parameters": {"type": "object"}, "strict": True}},
    ]
    assert template_tools(tools, None) == [  # vLLM's ChatCompletionToolsParam.model_dump()
        {"type": "function", "function": {"name": "a", "description": None, "parameters": None}},
        {
            "type": "function",
            "function": {"name": "b", "description": "B", "parameters": {"type": "object"}, "strict": True},
        },
    ]
    for bad, needle in [
        ({"type": "retrieval", "function": {"name": "a"}}, "tools\\[0\\] must be"),
        ({"type": "function"}, "tools\\[0\\] must be"),
        ({"function": {"name": 3}}, "tools\\[0\\].function.name"),
        ({"function": {"name": "a", "parameters": "object"}}, "tools\\[0\\].function.parameters"),
        ({"function": {"name": "a", "description": 1}}, "tools\\[0\\].function.description"),
    ]:
        with pytest.raises(APIError, match=needle):
            template_tools([bad], None)
    with pytest.raises(APIError, match="'c', which is not in tools"):
        template_tools(tools, "c")


def test_earlier_calls_get_object_arguments() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    out = template_message(message, 0)
    assert out["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": [1, 2]}}
    assert call["function"]["arguments"] == '{"x": [1, 2]}'  # the request itself is not changed
    empty = {"role": "assistant", "content": "x", "tool_calls": []}
    assert template_message(empty, 0) == {"role": "assistant", "content": "x"}
    no_arguments = {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}
    assert template_message(no_arguments, 0)["tool_calls"][0]["function"]["arguments"] == {}
    for bad, needle in [
        ({"tool_calls": "f"}, "tool_calls must be a list"),
        (
            {"tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
            r"tool_calls\[0\].function.arguments",
        ),
        (
            {"tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            r"tool_calls\[0\].function.arguments",
        ),
        ({"tool_calls": [{"type": "function"}]}, r"tool_calls\[0\] must be"),
        ({"tool_calls": [{"function": {"name": None}}]}, r"tool_calls\[0\].function.name"),
    ]:
        with pytest.raises(APIError, match=f"messages\\[3\\].{needle}"):
            template_message({"role": "assistant", "content": None, **bad}, 3)


def test_templates_that_never_read_tools_are_recognized() -> None:
    assert not template_reads_tools(OLD_TINY_TEMPLATE) and not template_reads_tools(None)
    assert template_reads_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert template_reads_tools({"default": OLD_TINY_TEMPLATE, "tool_use": "{{ tools }}"})


def _render(
    tokenizer: Any, body: ChatCompletionRequest, prefix: str = "", function: str | None = None
) -> str:
    ids = asyncio.run(Preprocessor(tokenizer, max_model_len=4096).chat(body, prefix, function))
    return tokenizer.decode(ids)


def test_plain_conversations_render_as_before_tools_existed(tokenizer: Any) -> None:
    conversations = [
        [{"role": "user", "content": "What is 1 + 2?"}],
        [
            {"role": "system", "content": "You are a helpful assistant"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"},
        ],
        [{"role": "developer", "content": "odd roles too"}, {"role": "user", "content": "x"}],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            new = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            old = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                chat_template=OLD_TINY_TEMPLATE,
            )
            assert new == old


def test_tools_calls_and_results_render_in_qwen3s_layout(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    text = _render(tokenizer, ChatCompletionRequest(messages=messages, tools=[WEATHER]))
    tool = json.dumps(
        {
            "type": "function",
            "function": {"name": "get_weather", "description": None, "parameters": {"type": "object"}},
        }
    )
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call these functions (signatures within "
        f"<tools></tools>):\n<tools>\n{tool}\n</tools>\n\nWrite each call within <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    # A forced opening ends the prompt; the named function must be one of the tools.
    prefix = '<tool_call>\n{"name": "get_weather", "arguments":'
    body = ChatCompletionRequest(messages=messages[:2], tools=[WEATHER])
    assert _render(tokenizer, body, prefix, "get_weather").endswith("<|im_start|>assistant\n" + prefix)
    with pytest.raises(APIError, match="not in tools"):
        _render(tokenizer, body, prefix, "get_time")


def test_tools_for_a_template_that_cannot_render_them_are_refused(tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    blind = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    blind.chat_template = OLD_TINY_TEMPLATE
    with pytest.raises(APIError, match="does not render tools") as info:
        _render(blind, ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER]))
    assert info.value.status == 400
    assert _render(
        blind, ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    )  # no tools: fine


def test_stats_speak_prometheus() -> None:
    stats = ToolCallStats(num_replies=3, num_calls=4, num_malformed=1, num_unknown=2)
    samples = {
        line.split()[0]: float(line.split()[1])
        for line in stats.prometheus().splitlines()
        if not line.startswith("#")
    }
    assert samples == {
        "prime_composer_tool_call_replies_total": 3,
        "prime_composer_tool_calls_total": 4,
        "prime_composer_tool_calls_malformed_total": 1,
        "prime_composer_tool_calls_unknown_total": 2,
    }
    assert "# TYPE prime_composer_tool_calls_total counter" in stats.prometheus()


def test_the_config_key_names_a_known_format(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from prime_composer.config.errors import ConfigError
    from prime_composer.config.inference import InferenceConfig
    from prime_composer.config.resolve import resolve_rl_config

    assert InferenceConfig().tool_call_parser == "hermes"
    assert InferenceConfig(tool_call_parser="none").tool_call_parser is None  # TOML has no null
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text("[inference]\ntool_call_parser = 'none'\n")
    assert resolve_rl_config(["@", "a.toml"])[0].inference.tool_call_parser is None
    (tmp_path / "b.toml").write_text("[inference]\ntool_call_parser = 'llama9'\n")
    with pytest.raises(ConfigError) as info:
        resolve_rl_config(["@", "b.toml"])
    message = str(info.value)
    assert "b.toml" in message and "inference.tool_call_parser" in message and "'hermes'" in message

"""A tiny Qwen3 that calls tools: the built-in tiny model fine-tuned until greedy decoding
reproduces a handful of tool-using replies, so tests go through real generation and the real chat
template (the random tiny model never writes a call by itself).

The conversations are rendered exactly as the inference servers render them (tools in vLLM's
normal form, call arguments as objects), and the fine-tuning stops only when every reply token is
the argmax by ``MIN_MARGIN``: greedy decoding then reproduces the replies on the ``hf`` backend
and on vLLM alike, whatever their rounding differences (~1e-5 in float32). Built once (about a
minute on 2 cores) and cached next to the tiny model, under a key of everything that shapes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from prime_composer.model.resolve import resolve_model_name
from prime_composer.model.tiny import default_cache_dir

MODEL = "builtin:tiny-qwen3"
MIN_MARGIN = 2.0
"""Smallest gap between the logit of each reply token and the next best one."""
_RECIPE_VERSION = 1

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": None,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
"""In vLLM's normal form already (what both servers render), so the prompts here are theirs."""


def call_text(arguments: dict[str, Any]) -> str:
    """A ``get_weather`` call as the tiny model's (Qwen3's) chat template writes it."""
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": text}]


PARIS = user("Weather in Paris?")
BOTH = user("Weather in Paris and Rome?")
OSLO = user("Weather in Oslo?")
ANSWER = [
    *PARIS,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

REPLIES: list[tuple[list[dict[str, Any]], str]] = [
    (PARIS, call_text({"city": "Paris"})),
    (BOTH, call_text({"city": "Paris"}) + "\n" + call_text({"city": "Rome"})),
    # Malformed on purpose: the city is not a JSON string.
    (OSLO, '<tool_call>\n{"name": "get_weather", "arguments": {"city": Oslo}}\n</tool_call>'),
    (ANSWER, "It is sunny."),
]
"""(messages, the reply the model is taught to give them, with ``TOOLS`` in the prompt)."""


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As both servers hand messages to the template: null content as "", call arguments as objects."""
    out = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tokenizer.apply_chat_template(
        _template_messages(messages), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def tool_caller_dir(cache_dir: Path | None = None) -> Path:
    """The fine-tuned model's directory (model + tokenizer), built on first use."""
    base = Path(resolve_model_name(MODEL))
    recipe = json.dumps(
        {"base": base.name, "tools": TOOLS, "replies": REPLIES, "margin": MIN_MARGIN, "v": _RECIPE_VERSION},
        sort_keys=True,
    )
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"tool-caller-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tool-caller-", dir=root))
    try:
        _fine_tune(base, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race to an identical build: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _fine_tune(base: Path, out_dir: Path, max_steps: int = 600) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = []
    for messages, reply in REPLIES:
        completion = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
        rows.append((prompt_ids(tokenizer, messages), completion))
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        sequence = prompt + completion
        ids[i, : len(sequence)] = torch.tensor(sequence)
        mask[i, : len(sequence)] = 1
        labels[i, len(prompt) - 1 : len(sequence) - 1] = torch.tensor(completion)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    for step in range(max_steps):
        logits = model(input_ids=ids, attention_mask=mask).logits
        if step % 10 == 0 and _margin(logits.detach(), labels) > MIN_MARGIN:
            break
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"the tool caller did not learn its replies in {max_steps} steps")
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _margin(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Smallest (logit of the label - best other logit) over the labelled positions."""
    keep = labels != -100
    scores, target = logits[keep], labels[keep]
    chosen = scores.gather(1, target[:, None])[:, 0]
    others = scores.scatter(1, target[:, None], float("-inf")).max(dim=1).values
    return float((chosen - others).min())

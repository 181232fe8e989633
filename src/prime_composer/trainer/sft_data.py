"""SFT data: chat JSONL -> token ids with a mask of the assistant tokens -> padded micro-batches.

Which tokens are trained on: for every assistant turn, the tokens the model would generate for
it, i.e. its content and its end-of-turn token. The role header the template puts before it
(``<|im_start|>assistant\\n``, the generation prompt) and any separator the template adds after the
end-of-turn token (a newline) are context, not targets: at inference time the server writes the
header and stops at the end-of-turn token.

How the spans are found, for any chat template: the conversation is rendered as text once; for
assistant turn ``i`` the template is rendered again on ``messages[:i]`` with the generation prompt
(where the turn starts) and on ``messages[:i + 1]`` (where it ends). Both must be *text* prefixes
of the full rendering, otherwise the template rewrites earlier turns (e.g. drops old reasoning)
and per-turn masks are not well defined: that is an error. Character spans are mapped to tokens
with the fast tokenizer's offsets (a token is trained when it starts inside a span), which is
robust to BPE merges at span boundaries that would make token-count differences wrong.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTSample:
    """One tokenized conversation; ``loss_mask[t]`` says token ``t`` is a training target (never
    the first token, which nothing predicts)."""

    input_ids: list[int]
    loss_mask: list[bool]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def read_conversations(path: Path) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(line_number, messages)`` for every non-blank line of the JSONL file ``path``.

    Raises ``ValueError`` naming the file and line for bad JSON, a missing or malformed
    ``messages`` list, or a conversation without an assistant turn.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data = '{path}': no such file; give a JSONL file of chat conversations")
    conversations = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                raise ValueError(
                    f'{where}: expected an object with a non-empty "messages" list, like '
                    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
                )
            for k, message in enumerate(messages):
                if not (
                    isinstance(message, dict)
                    and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)
                ):
                    raise ValueError(
                        f'{where}: messages[{k}] must have a string "role" and a string "content"'
                    )
            if not any(m["role"] == "assistant" for m in messages):
                raise ValueError(f"{where}: the conversation has no assistant turn, so nothing to train on")
            conversations.append((line_number, messages))
    if not conversations:
        raise ValueError(f"data = '{path}': the file has no conversations")
    return conversations


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def tokenize_conversation(messages: list[dict[str, Any]], tokenizer: Any) -> SFTSample:
    """Token ids of the rendered conversation and the mask of its assistant tokens (see module doc)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("SFT needs a fast (Rust) tokenizer for token offsets; this model's tokenizer is not")
    full = _render(tokenizer, messages, add_generation_prompt=False)
    # The template writes any BOS itself; add_special_tokens would add a second one.
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = encoded["input_ids"]
    starts = [start for start, _ in encoded["offset_mapping"]]
    stop_ids = {tokenizer.eos_token_id} - {None}

    mask = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            # transformers cannot render an empty conversation, so the turn's start is unknown.
            raise ValueError(
                "messages[0] is an assistant turn; start the conversation with a system or user turn"
            )
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"the chat template does not render messages[{i}] (assistant) as an extension of the "
                "earlier turns (it rewrites them, e.g. drops earlier reasoning); split the conversation "
                "so each line ends at the assistant turn to train"
            )
        span = [t for t, start in enumerate(starts) if len(before) <= start < len(through)]
        # Targets end at the turn's end-of-turn token; what the template adds after it is not generated.
        stops = [t for t in span if ids[t] in stop_ids]
        if stops:
            span = [t for t in span if t <= stops[-1]]
        for t in span:
            mask[t] = True
    mask[0] = False  # nothing predicts the first token
    return SFTSample(input_ids=ids, loss_mask=mask)


def load_sft_samples(path: Path, tokenizer: Any, seq_len: int) -> list[SFTSample]:
    """Read and tokenize ``path``, cutting conversations to ``seq_len`` tokens.

    Conversations with no assistant token left after the cut are dropped; both counts are logged.
    """
    samples = []
    num_truncated = num_dropped = 0
    for line_number, messages in read_conversations(path):
        try:
            sample = tokenize_conversation(messages, tokenizer)
        except ValueError as e:
            raise ValueError(f"{path}:{line_number}: {e}") from None
        if len(sample.input_ids) > seq_len:
            num_truncated += 1
            sample = SFTSample(sample.input_ids[:seq_len], sample.loss_mask[:seq_len])
        if not any(sample.loss_mask):
            num_dropped += 1
            continue
        samples.append(sample)
    if num_truncated:
        logger.warning(
            "%d of the conversations in %s are longer than seq_len = %d tokens and were cut",
            num_truncated,
            path,
            seq_len,
        )
    if num_dropped:
        logger.warning(
            "%d conversations in %s have no assistant token within seq_len = %d and are skipped",
            num_dropped,
            path,
            seq_len,
        )
    if not samples:
        raise ValueError(
            f"data = '{path}': no conversation has an assistant token within seq_len = {seq_len}"
        )
    return samples


def batch_indices(step: int, batch_size: int, num_samples: int, seed: int) -> list[int]:
    """Sample indices of optimizer step ``step`` (0-based): a window of ``batch_size`` over the
    endless sequence of per-epoch shuffles (epoch ``e`` shuffled with seed ``(seed, e)``).

    A pure function of the step, so a resumed run sees exactly the data it would have seen.
    """
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_samples)
        out.append(_epoch_order(seed, epoch, num_samples)[offset])
    return out


_ORDER_CACHE: dict[tuple[int, int, int], list[int]] = {}


def _epoch_order(seed: int, epoch: int, num_samples: int) -> list[int]:
    key = (seed, epoch, num_samples)
    if key not in _ORDER_CACHE:
        if len(_ORDER_CACHE) > 4:
            _ORDER_CACHE.clear()
        order = list(range(num_samples))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        _ORDER_CACHE[key] = order
    return _ORDER_CACHE[key]


@dataclass
class PaddedBatch:
    """Right-padded micro-batch: ``input_ids``, ``attention_mask`` and ``loss_mask``, all ``[B, T]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor


def collate(samples: list[SFTSample], pad_id: int) -> PaddedBatch:
    """Pad ``samples`` on the right to the longest one."""
    length = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), length), dtype=torch.bool)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask)
    return PaddedBatch(input_ids, attention_mask, loss_mask)

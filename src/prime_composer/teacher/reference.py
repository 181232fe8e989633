"""Token ids and reference logprobs of pairs, computed once in the service and stored with them.

Why here and not in the trainer or the inference server: the reference is the run's *initial*
policy, which the inference server stops serving after the first weight update, and the trainer
should not spend a forward on a fixed quantity every time a pair is replayed. So the service loads
``model.name`` with transformers (on ``reference.device``, CPU by default, ``num_threads`` threads)
and scores pending pairs in batches under ``torch.no_grad()``; torch is imported only when the
first pair needs it, so ``teacher --help`` stays fast.

Rendering: the context is the student's chat template applied to the state with the generation
prompt (``prompts.student_messages``), encoded without extra special tokens (as the inference
server does), unless the trace carries the exact ``prompt_token_ids``; each side is its action
text (``actions.render_action``) encoded and followed by the end-of-turn (eos) token, unless it
carries its own tokens (the trace's sampled action, or the student's sample for an on-policy
chosen side). Logprobs are ``log_softmax`` of the logits at temperature 1.
"""

from __future__ import annotations

import logging
from typing import Any

from prime_composer.config.base import ModelConfig
from prime_composer.config.teacher import ReferenceConfig

logger = logging.getLogger(__name__)


class ReferenceScorer:
    """Renders pairs into student tokens and scores completions under the reference weights."""

    def __init__(self, model: ModelConfig, cfg: ReferenceConfig) -> None:
        self.model_cfg = model
        self.cfg = cfg
        self._model: Any = None
        self._tokenizer: Any = None

    @property
    def name(self) -> str:
        return self.model_cfg.name

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from prime_composer.model.resolve import resolve_model_name

            self._tokenizer = AutoTokenizer.from_pretrained(
                resolve_model_name(self.model_cfg.name),
                revision=self.model_cfg.revision,
                trust_remote_code=self.model_cfg.trust_remote_code,
            )
        return self._tokenizer

    def load(self) -> None:
        """Load the tokenizer and the reference weights now (the service does this at start-up,
        off the event loop, so the first pairs do not wait for a cold import)."""
        _ = self.tokenizer
        self._load_model()

    def _load_model(self) -> Any:
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            from prime_composer.model.resolve import resolve_model_name

            torch.set_num_threads(self.cfg.num_threads)
            dtype = self.model_cfg.dtype
            if dtype == "auto":
                dtype = "float32" if self.cfg.device == "cpu" else "bfloat16"
            model: Any = AutoModelForCausalLM.from_pretrained(
                resolve_model_name(self.model_cfg.name),
                revision=self.model_cfg.revision,
                gguf_file=self.model_cfg.gguf_file,
                trust_remote_code=self.model_cfg.trust_remote_code,
                dtype=getattr(torch, dtype),
            )
            self._model = model.to(self.cfg.device).eval()
            logger.info("reference model %s loaded on %s", self.model_cfg.name, self.cfg.device)
        return self._model

    # ------------------------------------------------------------------------------- rendering

    def context_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def completion_ids(self, text: str, end: bool = True) -> list[int]:
        """``text``'s tokens, with the end token unless ``end`` is false."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        eos = self.tokenizer.eos_token_id
        return [*ids, eos] if eos is not None and end else ids

    def end_with_eos(self, ids: list[int]) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return ids if eos is None or (ids and ids[-1] == eos) else [*ids, eos]

    # --------------------------------------------------------------------------------- scoring

    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Reference logprob of each completion token given its context, for ``(context, completion)``
        pairs; batched by ``reference.batch_size``, right-padded."""
        import torch

        model = self._load_model()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        out: list[list[float]] = []
        with torch.no_grad():
            for start in range(0, len(sequences), self.cfg.batch_size):
                batch = sequences[start : start + self.cfg.batch_size]
                rows = [c + x for c, x in batch]
                width = max(len(r) for r in rows)
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                attention = torch.zeros((len(rows), width), dtype=torch.long)
                for i, row in enumerate(rows):
                    ids[i, : len(row)] = torch.tensor(row)
                    attention[i, : len(row)] = 1
                ids, attention = ids.to(self.cfg.device), attention.to(self.cfg.device)
                logits = model(input_ids=ids, attention_mask=attention).logits.float()
                logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
                targets = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
                for i, (context, completion) in enumerate(batch):
                    first = len(context) - 1  # the logit at position t predicts token t + 1
                    out.append(targets[i, first : first + len(completion)].tolist())
        return out

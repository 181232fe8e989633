"""Token-level constrained decoding of forced tool calls (``call_grammar``) for the decode loop.

Each vocabulary entry's text is known once per tokenizer (``TokenTable``). For a grammar state,
the allowed tokens are those whose whole text the automaton accepts from that state; the mask is
computed once per distinct state and kept (``GrammarMasks``, shared by every choice of a request
and by later requests with the same tools), so a long call costs a dictionary lookup per token
once its states have been seen. Two shortcuts keep a new state cheap:

- tokens are grouped by their first character; a group whose first character is refused is
  skipped whole (structural states allow a handful of characters);
- inside a JSON string value every token without ``"``, ``\\`` or a control character keeps the
  state as it is: those are allowed together, only the others are simulated.

Special tokens (end tokens included) are never allowed inside a call; once the call is complete
only the sequence's stop tokens are, so the reply ends right after it. A state that no token can
continue (a vocabulary that cannot spell the next character) allows the stop tokens: the reply
ends and the unfinished call is counted as malformed, never sampled from a masked-out row.

Masked logits are ``-inf``, so the logprobs of constrained tokens are those of the distribution
actually sampled from (the model's, renormalized over the allowed tokens).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from prime_composer.inference.call_grammar import CallGrammar, CallSpec

_PLAIN_FORBIDDEN = frozenset('"\\') | frozenset(chr(i) for i in range(0x20))
MAX_CACHED_GRAMMARS = 64


class TokenTable:
    """Each token id's text (``None``: never inside a call, e.g. special tokens), grouped by
    first character, and which tokens are plain string content."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        size = min(vocab_size, len(tokenizer))
        texts: list[str | None] = [None] * vocab_size
        for i in range(size):
            if i in special:
                continue
            text = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            texts[i] = text or None
        self.texts = texts
        groups: dict[str, list[int]] = {}
        plain = torch.zeros(vocab_size, dtype=torch.bool)
        for i, text in enumerate(texts):
            if text is None:
                continue
            groups.setdefault(text[0], []).append(i)
            if not _PLAIN_FORBIDDEN.intersection(text):
                plain[i] = True
        self.groups = groups
        self.plain = plain
        self.plain_ids = frozenset(plain.nonzero().flatten().tolist())


class GrammarMasks:
    """One grammar's allowed-token masks, by state (computed on first use, then kept)."""

    def __init__(self, grammar: CallGrammar, table: TokenTable) -> None:
        self.grammar, self.table = grammar, table
        self._masks: dict[Any, torch.Tensor] = {}
        self.num_states = 0

    def _in_plain_string(self, state: Any) -> bool:
        return state[0][-1] == ("S", 0, None)

    def allowed(self, state: Any) -> torch.Tensor | None:
        """Bool mask ``[vocab]`` of the tokens allowed in ``state``; ``None`` once the call is
        complete (the caller allows its stop tokens only)."""
        if self.grammar.done(state):
            return None
        mask = self._masks.get(state)
        if mask is None:
            mask = self._compute(state)
            self._masks[state] = mask
            self.num_states += 1
        return mask

    def _compute(self, state: Any) -> torch.Tensor:
        grammar, texts = self.grammar, self.table.texts
        plain_string = self._in_plain_string(state)
        mask = (
            self.table.plain.clone() if plain_string else torch.zeros(self.table.vocab_size, dtype=torch.bool)
        )
        allowed = []
        for first, ids in self.table.groups.items():
            after_first = grammar.step(state, first)
            if after_first is None:
                continue
            for i in ids:
                if plain_string and mask[i]:
                    continue
                text = texts[i]
                assert text is not None
                if grammar.feed(after_first, text[1:]) is not None:
                    allowed.append(i)
        if allowed:
            mask[torch.tensor(allowed)] = True
        return mask

    def advance(self, state: Any, token: int) -> Any:
        """The state after ``token`` (``None`` if it was not allowed)."""
        if self._in_plain_string(state) and token in self.table.plain_ids:
            return state
        text = self.table.texts[token] if token < self.table.vocab_size else None
        if text is None:
            return None
        return self.grammar.feed(state, text)


class CallConstraint:
    """One choice's position in a forced call (the decode loop keeps one per sequence)."""

    def __init__(self, masks: GrammarMasks, stop_ids: frozenset[int]) -> None:
        self.masks = masks
        self.state: Any = masks.grammar.start
        stops = [t for t in stop_ids if 0 <= t < masks.table.vocab_size]
        self._stop_mask = torch.zeros(masks.table.vocab_size, dtype=torch.bool)
        if stops:
            self._stop_mask[torch.tensor(stops)] = True

    def mask(self) -> torch.Tensor:
        if self.state is None:
            return self._stop_mask
        allowed = self.masks.allowed(self.state)
        if allowed is None or not bool(allowed.any()):
            return self._stop_mask
        return allowed

    def accept(self, token: int) -> None:
        if self.state is not None and not self.masks.grammar.done(self.state):
            self.state = self.masks.advance(self.state, token)


class ConstraintCache:
    """Masks by grammar, for one tokenizer: requests with the same tools reuse computed states."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._table: TokenTable | None = None
        self._grammars: OrderedDict[str, GrammarMasks] = OrderedDict()
        self._lock = threading.Lock()

    def masks(self, spec: CallSpec) -> GrammarMasks:
        with self._lock:
            if self._table is None:
                self._table = TokenTable(self._tokenizer, self._vocab_size)
            found = self._grammars.get(spec.key)
            if found is None:
                found = GrammarMasks(spec.grammar(), self._table)
                self._grammars[spec.key] = found
                while len(self._grammars) > MAX_CACHED_GRAMMARS:
                    self._grammars.popitem(last=False)
            else:
                self._grammars.move_to_end(spec.key)
            return found

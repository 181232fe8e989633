"""The continuous-batching decode loop of the ``hf`` backend.

One background thread owns the model. Requests are queued from the event loop; each iteration of
the thread

1. admits waiting requests (FIFO, up to ``max_num_seqs`` sequences and ``max_prefill_tokens``
   padded prompt tokens) and prefills them together in one forward, sampling their first token;
2. rebuilds the batch KV cache once if sequences joined or left (``kv_cache.gather``);
3. decodes one token for every running sequence in one batched forward (``q_len = 1``, per-row
   start columns in the attention mask, per-row position ids);
4. hands each request the tokens its choices produced, and marks finished sequences, which leave
   the batch at the next rebuild.

A request with ``n`` choices is prefilled once and its cache row copied ``n`` times. Prompts of
one prefill batch that start with the same tokens (a system prompt) run that prefix once
(``MIN_SHARED_PREFIX`` tokens at least). Logits come from the decoder's last hidden states through
``output_head`` (a prepacked output layer on CPU) when that computes the model's own logits, and
the decoder layers through ``fused_decoder`` (prepacked, fused oneDNN products) when that computes
the model's own decoder; otherwise the model's own forward runs.

Where a decode step's time goes (SmolLM2-135M, 16 rows, 1 CPU thread, fused layers): ~70% in the
linear layers' matrix products (~91 ms CPU per step, against ~129 ms with the model's own forward),
~15% attention, the rest norms, rotary embeddings and sampling. The numbers and what limits them are in ``bench/README.md``.

Weight swaps (``update_weights``) are atomic per request: once a swap is pending no new request
is admitted, the running ones finish on the old weights, the weights are swapped between two
iterations, and admission resumes. Every completion is therefore produced by one set of weights.

Attention masks are explicit 4D masks (bool for SDPA-based kernels, including the grouped-query
one in ``attention``; additive for eager). A padded prompt position attends only to earlier
padding, so no softmax row is ever empty (no NaN reaches the cache), and real tokens never attend
to padding.

Logprobs are computed from the same logits the tokens are sampled from (``sampling``); the
tests compare them with a plain full-sequence forward of the Hugging Face model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from prime_composer.inference.hf.allocator import keep_freed_memory
from prime_composer.inference.hf.constrain import CallConstraint, ConstraintCache
from prime_composer.inference.hf.detokenize import IncrementalDetokenizer
from prime_composer.inference.hf.fused_decoder import FusedDecoder, fused_decoder
from prime_composer.inference.hf.kv_cache import BatchKVCache, RowSource, gather
from prime_composer.inference.hf.output_head import packed_output_head
from prime_composer.inference.hf.sampling import make_generator, sample_rows
from prime_composer.inference.hf.weight_swap import WeightSwapper
from prime_composer.inference.requests import ChoiceUpdate, EngineError, GenerationRequest
from prime_composer.transport.adapter import Adapter

logger = logging.getLogger(__name__)

MIN_SHARED_PREFIX = 8
"""Shortest common prompt prefix run once for a prefill batch; a shorter one saves less than the
extra forward costs."""


@dataclass
class _Handle:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    cancelled: bool = False

    def push(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancelled = True


@dataclass
class _Sequence:
    handle: _Handle
    index: int
    generator: torch.Generator
    stop_ids: frozenset[int]
    detok: IncrementalDetokenizer | None
    start: int = 0
    """First cache column holding this sequence's tokens."""
    last_token: int = -1
    num_tokens: int = 0
    finished: bool = False
    update: ChoiceUpdate | None = None
    constraint: CallConstraint | None = None
    """A forced tool call's grammar state (``hf.constrain``), when the request has one."""


@dataclass
class _Swap:
    state_dict: Mapping[str, torch.Tensor] | None  # None: back to the base weights
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class Engine:
    """Owns the model on a background thread; ``generate`` and ``update_weights`` are async.

    ``max_model_len`` bounds prompt + ``max_tokens``; ``max_num_seqs`` sequences are decoded
    together at most; ``max_prefill_tokens`` bounds one prefill forward (see ``InferenceConfig``);
    ``seed`` seeds the generators of requests that bring no seed; ``fused_layers=False`` keeps the
    model's own decoder forward even where ``fused_decoder`` could replace it (for comparisons).
    ``start`` before use, ``stop`` at the end (it fails whatever is still waiting or running).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 8192,
        seed: int = 0,
        fused_layers: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        # eager attention adds the mask to the scores; every other supported kernel takes bool masks.
        self._bool_masks = getattr(model.config, "_attn_implementation", "sdpa") != "eager"
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._waiting: deque[_Handle] = deque()
        self._rows: list[_Sequence] = []
        self._cache: BatchKVCache | None = None
        self._swap: _Swap | None = None
        self._weights = WeightSwapper(model)
        if self.device.type == "cpu":
            keep_freed_memory()  # no page faults for each step's megabytes of fresh tensors
        self._head = packed_output_head(model)
        self._fused: FusedDecoder | None = None
        if fused_layers and self._head is not None:  # it ends at the last hidden state: the head follows
            self._fused = fused_decoder(model, rows=min(max_num_seqs, 64))
        self._constraints = ConstraintCache(tokenizer, self.vocab_size)
        self.constraint_seconds = 0.0
        """Time spent masking logits for forced tool calls (a statistic: ``hf.constrain``)."""
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.num_shared_prefix_tokens = 0
        """Prompt tokens not recomputed because a prefill batch shared a prefix (a statistic)."""

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hf-decode-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        error = EngineError("the inference server is shutting down")
        for handle in [*self._waiting, *(s.handle for s in self._rows)]:
            handle.push(error)
        self._waiting.clear()
        self._rows = []
        if self._swap is not None:
            _settle(self._swap, error)

    # ----------------------------------------------------------------- requests

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` (a 400 for the client) for a request the loop cannot serve."""
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
        # The length first: it bounds the scans below (a huge token list is refused in O(1)).
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt)} and max_tokens asks for {params.max_tokens} more "
                f"({len(prompt) + params.max_tokens} in all): shorten the prompt or lower max_tokens"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"invalid prompt token ids {bad[:5]}: ids must be in [0, {self.vocab_size})")
        if len(params.stop_token_ids) > self.vocab_size:
            raise ValueError(
                f"{len(params.stop_token_ids)} stop_token_ids for a vocabulary of {self.vocab_size}"
            )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"invalid stop_token_ids {bad_stop[:5]}: ids must be in [0, {self.vocab_size})")
        if request.call is not None and params.ignore_eos:
            raise ValueError(
                "a forced tool call ends with an end token: it cannot be combined with ignore_eos"
            )
        if not 1 <= params.n <= self.max_num_seqs:
            raise ValueError(
                f"n must be in [1, {self.max_num_seqs}] (inference.max_num_seqs), got {params.n}"
            )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        """Yield, per iteration, the updates of this request's choices until all have finished."""
        self.check_request(request)
        handle = _Handle(request, asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if self._stopping:
                raise EngineError("the inference server is shutting down")
            self._waiting.append(handle)
            self._cond.notify()
        num_open = request.params.n
        try:
            while num_open:
                item = await handle.queue.get()
                if isinstance(item, BaseException):
                    raise item
                num_open -= sum(u.finish_reason is not None for u in item)
                yield item
        finally:
            if num_open:  # the caller went away: free the batch slots
                handle.cancelled = True

    # ----------------------------------------------------------------- weights

    def check_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` unless ``state_dict`` covers exactly this model's weights."""
        self._weights.check(state_dict)

    def adapter_state_dict(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        """The full state dict serving LoRA ``adapter`` on the base weights (``ValueError`` when it
        does not fit); pass it to ``update_weights``."""
        return self._weights.with_adapter(adapter)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor] | None) -> None:
        """Swap in ``state_dict`` (``None``: the weights loaded at start) between requests."""
        if state_dict is not None:
            self.check_state_dict(state_dict)
        loop = asyncio.get_running_loop()
        swap = _Swap(state_dict, loop, loop.create_future())
        with self._cond:
            if self._swap is not None:
                raise EngineError("another weight update is in progress")
            if self._stopping:
                raise EngineError("the inference server is shutting down")
            self._swap = swap
            self._cond.notify()
        await swap.future

    # ----------------------------------------------------------------- the loop

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._rows or self._swap):
                    self._cond.wait()
                if self._stopping:
                    return
                admitted = [] if self._swap is not None else self._admit()
                swap = self._swap if (self._swap is not None and not self._rows) else None
            if swap is not None:
                error = self._apply_swap(swap)
                with self._cond:
                    self._swap = None  # before the caller hears back, so it may update again at once
                _settle(swap, error)
                continue
            try:
                with torch.inference_mode():
                    self._step(admitted)
            except Exception as e:  # a bad batch must not kill the server
                logger.exception("decode loop iteration failed; failing its requests")
                error = EngineError(f"generation failed: {type(e).__name__}: {e}")
                for handle in {id(h): h for h in [*admitted, *(s.handle for s in self._rows)]}.values():
                    handle.push(error)
                self._rows, self._cache = [], None

    def _admit(self) -> list[_Handle]:
        """Take waiting requests that fit (called with the lock held)."""
        admitted: list[_Handle] = []
        num_seqs = sum(not s.finished for s in self._rows)
        longest = 0
        while self._waiting:
            handle = self._waiting[0]
            if handle.cancelled:
                self._waiting.popleft()
                continue
            n = handle.request.params.n
            longest_if = max(longest, len(handle.request.prompt_ids))
            if num_seqs + n > self.max_num_seqs:
                break
            if admitted and longest_if * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            admitted.append(handle)
            num_seqs += n
            longest = longest_if
        return admitted

    def _step(self, admitted: list[_Handle]) -> None:
        for seq in self._rows:
            if seq.handle.cancelled and not seq.finished:
                seq.finished = True
        new_rows: list[_Sequence] = []
        prefill_cache: BatchKVCache | None = None
        prefill_rows: list[int] = []
        if admitted:
            new_rows, prefill_cache, prefill_rows = self._prefill(admitted)
        self._rebuild(new_rows, prefill_cache, prefill_rows)
        if self._rows:
            self._decode()
        self._flush([*self._rows, *(s for s in new_rows if s.finished)])
        if all(s.finished for s in self._rows):
            self._rows, self._cache = [], None

    def _prefill(self, handles: list[_Handle]) -> tuple[list[_Sequence], BatchKVCache, list[int]]:
        """One forward over the left-padded prompts; returns the new sequences with a first token.

        When the prompts start with the same ``num_shared`` tokens (a system prompt, a few-shot
        header), that prefix is run once and its keys/values copied to every row; the batched
        forward then covers only the rest of each prompt.
        """
        prompts = [h.request.prompt_ids for h in handles]
        num_shared = _shared_prefix_length(prompts) if len(prompts) > 1 else 0
        if num_shared < MIN_SHARED_PREFIX:
            num_shared = 0
        cache = self._prefix_cache(prompts[0][:num_shared], len(prompts))
        suffixes = [p[num_shared:] for p in prompts]
        length = max(len(p) for p in suffixes)
        starts = torch.tensor([length - len(p) for p in suffixes], device=self.device)
        input_ids = torch.tensor(
            [[self._pad_id] * (length - len(p)) + p for p in suffixes], device=self.device
        )
        q = torch.arange(length, device=self.device)
        causal = q.unsqueeze(0) <= q.unsqueeze(1)  # [query, key]
        key_is_real = q.unsqueeze(0) >= starts.unsqueeze(1)  # [row, key]
        query_is_pad = q.unsqueeze(0) < starts.unsqueeze(1)  # [row, query]
        allowed = causal.unsqueeze(0) & (key_is_real.unsqueeze(1) | query_is_pad.unsqueeze(2))
        if num_shared:  # every query also sees the shared prefix, cache columns [0, num_shared)
            prefix = torch.ones((len(prompts), length, num_shared), dtype=torch.bool, device=self.device)
            allowed = torch.cat([prefix, allowed], dim=-1)
        positions = num_shared + (q.unsqueeze(0) - starts.unsqueeze(1)).clamp(min=0)
        last_logits = self._forward_last(input_ids, positions, allowed.unsqueeze(1), cache)
        if num_shared:
            # Row r holds [prefix | r's padding | r's suffix]; move its prefix right, next to its
            # suffix, so that every row is again one run of columns [start, length).
            cache.shift_prefix(starts.tolist(), num_shared)
            self.num_shared_prefix_tokens += num_shared * (len(prompts) - 1)
        sequences: list[_Sequence] = []
        rows: list[int] = []
        for row, handle in enumerate(handles):
            for index in range(handle.request.params.n):
                seq = self._new_sequence(handle, index)
                seq.start = length - len(suffixes[row])
                sequences.append(seq)
                rows.append(row)
        self._sample_and_accept(sequences, last_logits[torch.tensor(rows, device=self.device)])
        return sequences, cache, rows

    def _prefix_cache(self, prefix: list[int], num_rows: int) -> BatchKVCache:
        """A cache of ``num_rows`` rows that all hold ``prefix`` (empty: an empty cache)."""
        cache = BatchKVCache(self._num_layers)
        if not prefix:
            return cache
        q = torch.arange(len(prefix), device=self.device)
        causal = (q.unsqueeze(0) <= q.unsqueeze(1))[None, None]  # [1, 1, query, key]
        # The decoder alone: the prefix's logits are not needed.
        ids = torch.tensor([prefix], device=self.device)
        if self._fused is not None:
            self._fused(ids, q.unsqueeze(0), causal, cache)
        else:
            self.model.get_decoder()(
                input_ids=ids,
                attention_mask=self._mask(causal),
                position_ids=q.unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
            )
        repeated, _ = gather([RowSource(cache, [0] * num_rows, 0)])
        return repeated

    def _decode(self) -> None:
        assert self._cache is not None
        length = self._cache.length
        starts = torch.tensor([s.start for s in self._rows], device=self.device)
        input_ids = torch.tensor([[s.last_token] for s in self._rows], device=self.device)
        columns = torch.arange(length + 1, device=self.device)
        allowed = columns.unsqueeze(0) >= starts.unsqueeze(1)  # [row, key]
        logits = self._forward_last(
            input_ids, (length - starts).unsqueeze(1), allowed[:, None, None, :], self._cache
        )
        self._sample_and_accept(self._rows, logits)

    def _forward_last(
        self, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, cache: BatchKVCache
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` at the last position of a forward of ``input_ids`` ``[rows, q]``
        at ``positions``, attending where ``allowed`` (bool ``[rows, 1, q, keys]``), over ``cache``."""
        if self._fused is not None:
            assert self._head is not None
            return self._head(self._fused(input_ids, positions, allowed, cache))
        inputs = {
            "input_ids": input_ids,
            "attention_mask": self._mask(allowed),
            "position_ids": positions,
            "past_key_values": cache,
            "use_cache": True,
        }
        if self._head is None:
            return self.model(**inputs, logits_to_keep=1).logits[:, -1]
        hidden = self.model.get_decoder()(**inputs).last_hidden_state
        return self._head(hidden[:, -1].contiguous())

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if self._bool_masks:
            return allowed
        dtype = self.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    def _rebuild(
        self, new_rows: list[_Sequence], prefill_cache: BatchKVCache | None, prefill_rows: list[int]
    ) -> None:
        """Drop finished rows and append unfinished new ones, in one copy of the cache."""
        kept = [i for i, s in enumerate(self._rows) if not s.finished]
        joining = [j for j, s in enumerate(new_rows) if not s.finished]
        if len(kept) == len(self._rows) and not joining:
            return
        if not kept and not joining:
            self._rows, self._cache = [], None
            return
        sources = []
        if kept:
            assert self._cache is not None
            first = min(self._rows[i].start for i in kept)
            sources.append(RowSource(self._cache, kept, first))
        if joining:
            assert prefill_cache is not None
            first = min(new_rows[j].start for j in joining)
            sources.append(RowSource(prefill_cache, [prefill_rows[j] for j in joining], first))
        self._cache, shifts = gather(sources)
        rows = [self._rows[i] for i in kept]
        for seq in rows:
            seq.start += shifts[0]
        new = [new_rows[j] for j in joining]
        for seq in new:
            seq.start += shifts[-1]
        self._rows = rows + new

    # ----------------------------------------------------------------- tokens

    def _new_sequence(self, handle: _Handle, index: int) -> _Sequence:
        request = handle.request
        params = request.params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        detok = None
        if request.detokenize or params.stop:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
        constraint = None
        if request.call is not None:
            constraint = CallConstraint(self._constraints.masks(request.call), frozenset(stop_ids))
        return _Sequence(
            handle=handle,
            index=index,
            generator=make_generator(seed, index, self.device),
            stop_ids=frozenset(stop_ids),
            detok=detok,
            constraint=constraint,
        )

    def _sample_and_accept(self, rows: list[_Sequence], logits: torch.Tensor) -> None:
        params = [s.handle.request.params for s in rows]
        constrained = [i for i, s in enumerate(rows) if s.constraint is not None]
        if constrained:
            started = time.perf_counter()
            masks = torch.stack([rows[i].constraint.mask() for i in constrained]).to(logits.device)  # type: ignore[union-attr]
            index = torch.tensor(constrained, device=logits.device)
            logits = logits.float()  # a copy when it was not float32 already; indexed assignment below
            logits[index] = logits[index].masked_fill(~masks, float("-inf"))
            self.constraint_seconds += time.perf_counter() - started
        sampled = sample_rows(
            logits,
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            generators=[s.generator for s in rows],
            num_top=max(p.num_top_logprobs for p in params),
        )
        if not all(map(math.isfinite, sampled.logprobs)):
            # Never hand out a NaN logprob as data (JSON would carry it as null or NaN): the
            # weights are broken (update_weights refuses non-finite ones, so this is a bug).
            raise RuntimeError("the model produced non-finite logits (NaN or inf)")
        for i, seq in enumerate(rows):
            top = sampled.top_logprobs[i][: params[i].num_top_logprobs] if sampled.top_logprobs else []
            self._accept(seq, sampled.token_ids[i], sampled.logprobs[i], top)

    def _accept(self, seq: _Sequence, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        params = seq.handle.request.params
        seq.last_token = token
        seq.num_tokens += 1
        update = seq.update or ChoiceUpdate(index=seq.index)
        seq.update = update
        update.token_ids.append(token)
        update.logprobs.append(logprob)
        update.top_logprobs.append(top)
        if seq.constraint is not None:
            seq.constraint.accept(token)
        if seq.detok is not None:
            seq.detok.add(token)
        if token in seq.stop_ids:
            update.finish_reason = "stop"
            update.stop_reason = token if token in params.stop_token_ids else None
        elif seq.detok is not None and seq.detok.stop_hit is not None:
            update.finish_reason, update.stop_reason = "stop", seq.detok.stop_hit
        elif seq.num_tokens >= params.max_tokens:
            update.finish_reason = "length"
        seq.finished = update.finish_reason is not None
        if seq.detok is not None:
            if seq.finished:
                seq.detok.flush()
            update.text += seq.detok.take_delta(final=seq.finished)

    def _flush(self, rows: list[_Sequence]) -> None:
        """Hand every request the updates its choices produced in this iteration."""
        per_handle: dict[int, tuple[_Handle, list[ChoiceUpdate]]] = {}
        for seq in rows:
            if seq.update is None:
                continue
            if not seq.handle.cancelled:
                per_handle.setdefault(id(seq.handle), (seq.handle, []))[1].append(seq.update)
            seq.update = None
        for handle, updates in per_handle.values():
            handle.push(updates)

    # ----------------------------------------------------------------- swaps

    def _apply_swap(self, swap: _Swap) -> EngineError | None:
        try:
            self._weights.apply(swap.state_dict)
            if self._head is not None:
                self._head.refresh()
            if self._fused is not None:
                self._fused.refresh()
            return None
        except Exception as e:
            logger.exception("weight swap failed")
            return EngineError(f"weight swap failed: {type(e).__name__}: {e}")


def _settle(swap: _Swap, error: BaseException | None) -> None:
    def done() -> None:
        if swap.future.done():
            return
        if error is None:
            swap.future.set_result(None)
        else:
            swap.future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody to tell
        swap.loop.call_soon_threadsafe(done)


def _shared_prefix_length(prompts: list[list[int]]) -> int:
    """Length of the longest common prefix, leaving every prompt at least one token of its own
    (its last position gives the logits of its first sampled token)."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for i in range(limit):
        token = first[i]
        if any(p[i] != token for p in prompts):
            return i
    return max(limit, 0)


def _eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids from the tokenizer, the model config and the generation config (as vLLM stops)."""
    ids: set[int] = set()
    sources = [
        tokenizer.eos_token_id,
        getattr(model.config, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids

"""The replay channel end to end inside one process: pairs from a source, packed into the ``replay``
group, trained on by the replay term, with the loss checked against an independent computation
(plain unpacked forwards of each side, the DPO formula written out) and nothing run at weight 0."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from prime_composer.config.errors import ConfigError
from prime_composer.config.loss import LossConfig
from prime_composer.config.orchestrator import ReplaySourceConfig
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.config.teacher import TraceSourceConfig
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.replay.packing import ReplayPacker
from prime_composer.orchestrator.replay.source import PairSource
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.trace_export import episode_trace
from prime_composer.teacher.pairs import Pair
from prime_composer.teacher.traces import parse_trace
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.step import train_step
from prime_composer.transport.batch import BatchFormatError, MicroBatch, decode_rank_batch, encode_rank_batch
from prime_composer.transport.groups import ReplayGroup

SEQ_LEN = 40


def pair(rng: random.Random, cursor: int, smoothing: float = 0.1) -> Pair:
    context = [rng.randint(3, 400) for _ in range(rng.randint(3, 8))]
    chosen = [rng.randint(3, 400) for _ in range(rng.randint(2, 6))]
    rejected = [rng.randint(3, 400) for _ in range(rng.randint(2, 6))]
    return Pair(
        cursor=cursor,
        trace_id=f"t{cursor}",
        turn_index=1,
        state_hash=f"s{cursor}",
        context_ids=context,
        chosen_ids=chosen,
        rejected_ids=rejected,
        ref_chosen_logprobs=[-rng.uniform(3, 7) for _ in chosen],
        ref_rejected_logprobs=[-rng.uniform(3, 7) for _ in rejected],
        label_smoothing=smoothing,
        vote_share=1 - smoothing,
        margin=0.7,
        process_reward=-0.7,
        chosen_source="teacher",
        chosen_text="",
        rejected_text="",
        reference_model="tiny",
        provenance={},
    )


def sample(i: int) -> Sample:
    return Sample([5, 6, 7], [8, 9], [-1.0, -1.0], [1, 1], float(i % 2), i, i, 0, advantage=0.5 - i % 2)


def pack(pairs: list[Pair], micro_batch_size: int = 8) -> list[MicroBatch]:
    (mbs,), _ = pack_step(
        [sample(i) for i in range(4)],
        SEQ_LEN,
        micro_batch_size,
        1,
        0,
        packers=[ReplayPacker()],
        extras={"replay": pairs},
    )
    return mbs


def test_pairs_are_packed_side_by_side_with_their_reference_logprobs() -> None:
    rng = random.Random(0)
    pairs = [pair(rng, c) for c in range(1, 6)]
    (mb,) = pack(pairs)
    group = mb.group(ReplayGroup)
    assert group is not None and group.num_pairs == 5
    for index, p in enumerate(pairs):
        for side, refs, is_chosen in (
            (p.chosen_ids, p.ref_chosen_logprobs, True),
            (p.rejected_ids, p.ref_rejected_logprobs, False),
        ):
            select = group.side_mask & (group.pair_ids == index) & (group.is_chosen == is_chosen)
            assert group.input_ids[select].tolist() == side
            assert group.ref_logprobs[select].tolist() == pytest.approx(refs)
            # The side follows its context in the same row.
            row, cols = select.nonzero(as_tuple=True)
            start = int(cols[0]) - len(p.context_ids)
            assert group.input_ids[row[0], start : int(cols[0])].tolist() == p.context_ids
            assert group.position_ids[row[0], start].item() == 0
    assert group.label_smoothing.tolist() == pytest.approx([0.1] * 5)
    _, _, (decoded,) = decode_rank_batch(encode_rank_batch(0, 0, [mb]))
    assert torch.equal(decoded.group(ReplayGroup).side_mask, group.side_mask)  # type: ignore[union-attr]


def test_too_long_pairs_are_dropped_and_counted() -> None:
    rng = random.Random(1)
    long = pair(rng, 1)
    long = Pair(**{**long.__dict__, "context_ids": [3] * SEQ_LEN})
    _, stats = pack_step(
        [sample(0), sample(1)],
        SEQ_LEN,
        4,
        1,
        0,
        packers=[ReplayPacker()],
        extras={"replay": [long, pair(rng, 2)]},
    )
    assert stats.metrics()["replay/pack_dropped"] == 1 and stats.metrics()["replay/packed_pairs"] == 1


def test_a_pair_missing_a_side_is_refused() -> None:
    rng = random.Random(2)
    (mb,) = pack([pair(rng, 1)])
    group = mb.group(ReplayGroup)
    assert group is not None
    broken = group.is_chosen.clone()
    broken[group.side_mask] = True  # every side token marked chosen: no rejected side left
    with pytest.raises(BatchFormatError, match="no rejected tokens"):
        MicroBatch(
            **mb.core_tensors(), groups={"replay": ReplayGroup(**{**group.tensors(), "is_chosen": broken})}
        )


@pytest.fixture(scope="module")
def model_path() -> str:
    torch.set_num_threads(1)
    return resolve_model_name("builtin:tiny-qwen3")


def load(path: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")


def side_logp(model: torch.nn.Module, context: list[int], side: list[int]) -> torch.Tensor:
    ids = torch.tensor([context + side])
    logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return logp[len(context) - 1 :].sum()


def test_replay_term_matches_the_dpo_formula_on_plain_forwards(model_path: str) -> None:
    rng = random.Random(3)
    pairs = [pair(rng, c, smoothing=0.05 * c) for c in range(1, 5)]
    mbs = pack(pairs, micro_batch_size=1)  # pairs spread over several micro-batches
    weight, beta = 0.3, 0.2
    cfg = LossConfig(rl={"weight": 0.0}, replay={"weight": weight, "beta": beta})
    model = load(model_path)
    ctx = TermContext(model)
    terms = build_terms(cfg, ctx)
    assert [t.name for t in terms] == ["replay"]
    result = train_step(model, mbs, terms, torch.device("cpu"))
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = load(model_path)
    total = torch.zeros((), dtype=torch.float64)
    for p in pairs:
        h = (side_logp(reference, p.context_ids, p.chosen_ids) - sum(p.ref_chosen_logprobs)) - (
            side_logp(reference, p.context_ids, p.rejected_ids) - sum(p.ref_rejected_logprobs)
        )
        eps = p.label_smoothing
        total = total - (1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    (weight * total / len(pairs)).backward()
    assert result.metrics["loss/replay"] == pytest.approx(float(total.detach()) / len(pairs), rel=1e-6)
    assert result.metrics["replay/num_pairs"] == len(pairs)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(
            got[name], param.grad, rtol=1e-5, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_weight_zero_builds_no_term_and_runs_no_pair_forward(model_path: str) -> None:
    model = load(model_path)
    ctx = TermContext(model)
    assert [t.name for t in build_terms(LossConfig(), ctx)] == ["rl"]  # the pairs are never looked at


class FakeStore:
    def __init__(self, pairs: list[Pair]) -> None:
        self.pairs = pairs

    def take(self, n: int, after_cursor: int = 0) -> list[Pair]:
        return [p for p in self.pairs if p.cursor > after_cursor][:n]

    def newest_cursor(self) -> int:
        return max((p.cursor for p in self.pairs), default=0)


def test_the_source_takes_each_pair_once_and_resumes_from_its_cursor(tmp_path: Path) -> None:
    rng = random.Random(4)
    source = PairSource(ReplaySourceConfig(enabled=True, pairs_per_step=3), tmp_path)
    source.teacher.store = FakeStore([pair(rng, c) for c in range(1, 9)])  # type: ignore[assignment]
    first = asyncio.run(source.take(0))
    assert [p.cursor for p in first] == [1, 2, 3]
    saved = source.state_dict()
    second = asyncio.run(source.take(1))
    resumed = PairSource(ReplaySourceConfig(enabled=True, pairs_per_step=3), tmp_path)
    resumed.teacher.store = source.teacher.store
    resumed.load_state_dict(saved)
    assert [p.cursor for p in asyncio.run(resumed.take(1))] == [p.cursor for p in second] == [4, 5, 6]
    assert [p.cursor for p in asyncio.run(source.take(2))] == [7, 8] and asyncio.run(source.take(3)) == []


def test_pairs_older_than_max_pair_age_are_skipped_and_the_ages_are_logged(tmp_path: Path) -> None:
    """10 pairs become ready at step 0, 10 more at step 3; 3 are taken per step. By hand, with
    max_pair_age = 2: steps 0-2 take cursors 1-9 (ready at step 0: ages 0, 1, 2); at step 3 cursor 10
    is 3 steps old and skipped, 11-13 (ready at 3) are taken at age 0; steps 4 and 5 take 14-19 at
    ages 1 and 2; at step 6 cursor 20 is stale."""
    rng = random.Random(5)
    source = PairSource(ReplaySourceConfig(enabled=True, pairs_per_step=3, max_pair_age=2), tmp_path)
    store = FakeStore([pair(rng, c) for c in range(1, 11)])
    source.teacher.store = store  # type: ignore[assignment]
    taken, rows = {}, {}
    for step in range(7):
        if step == 3:
            store.pairs += [pair(rng, c) for c in range(11, 21)]
        taken[step] = [p.cursor for p in asyncio.run(source.take(step))]
        rows[step] = source.metrics()
        if step == 4:  # a resumed source knows the ages too
            saved = source.state_dict()
            source = PairSource(ReplaySourceConfig(enabled=True, pairs_per_step=3, max_pair_age=2), tmp_path)
            source.teacher.store = store  # type: ignore[assignment]
            source.load_state_dict(saved)
    assert taken == {
        0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9], 3: [11, 12, 13], 4: [14, 15, 16], 5: [17, 18, 19], 6: [],
    }  # fmt: skip
    assert [rows[s]["replay/pair_age_max"] for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [rows[s]["replay/pairs_stale"] for s in range(7)] == [0, 0, 0, 1, 0, 0, 1]
    # Without the limit every pair is taken in turn, up to 3 steps old here.
    plain = PairSource(ReplaySourceConfig(enabled=True, pairs_per_step=3), tmp_path)
    plain.teacher.store = FakeStore(store.pairs[:10])  # type: ignore[assignment]
    ages = []
    for step in range(4):
        asyncio.run(plain.take(step))
        ages.append(plain.metrics()["replay/pair_age_max"])
    assert ages == [0, 1, 2, 3] and plain.cursor == 10


def test_rollouts_become_valid_traces() -> None:
    s = Sample(
        [1, 2, 3], [4, 5, 6], [-0.1, -0.2, -0.3], [1, 1, 1], 1.0, 0, 0, 0,
        episode=EpisodeRecord(messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
              trace_id="abc", task={"answer": "4"}),
    )  # fmt: skip
    trace = episode_trace([s])
    assert trace is not None
    parsed = parse_trace(trace, "rollout", TraceSourceConfig())
    last = parsed.turns[-1]
    assert last.token_ids == [4, 5, 6] and last.prompt_token_ids == [1, 2, 3]
    assert (
        last.logprobs == pytest.approx([-0.1, -0.2, -0.3])
        and math.isclose(parsed.record.reward or 0, 1.0)
        and parsed.trace_id == "abc"
    )
    assert last.finish_reason is None  # stopped on its own: the pair's side gets its end token
    assert episode_trace([Sample([1], [], [], [], 0.0, 0, 0, 0, error="boom")]) is None
    # A rollout cut at max_tokens says so, so its rejected side gets no end token it never sampled.
    s.is_truncated = True
    cut = parse_trace(episode_trace([s]) or {}, "rollout", TraceSourceConfig())
    assert cut.turns[-1].finish_reason == "length"


def test_both_halves_of_the_channel_must_be_on() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.loss\.replay\.weight = 0"):
        resolve_rl_config(["--orchestrator.replay.enabled"])
    with pytest.raises(ConfigError, match=r"orchestrator\.replay\.enabled = false"):
        resolve_rl_config(["--trainer.loss.replay.weight", "0.1"])

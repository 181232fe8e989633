"""``ChannelGRPOTrainer`` (``integrations/trl.py``) against our own trainer step on the same batch.

The same tiny model (``builtin:tiny-qwen3``, float64), the same samples with the same SDPO hints
(the project's ``HintBuilder``, sibling source) and the same replay pairs go once through
``train_step`` with the ``rl`` (token-mean), ``sdpo`` and ``replay`` terms, and once through the TRL
trainer's ``compute_loss`` (TRL's ``dapo`` GRPO loss plus our channel terms), in TRL's own batch
layout (left-padded prompts, right-padded completions). Loss and every parameter gradient must
agree. TRL's GRPO part is independent code; our terms are shared, so the check is that the
integration feeds them the same data, normalizers and scaling as our trainer does.
"""

from __future__ import annotations

import ast
import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

pytest.importorskip("trl")  # a dev dependency: present wherever the suite runs

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from prime_composer.config.loss import LossConfig
from prime_composer.config.sdpo import HintConfig
from prime_composer.integrations.trl import ChannelGRPOTrainer, TRLChannels, deal
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.replay.packing import ReplayPacker
from prime_composer.orchestrator.sample import Sample
from prime_composer.orchestrator.sdpo.hints import HintBuilder
from prime_composer.orchestrator.sdpo.packing import SDPOPacker
from prime_composer.teacher.pairs import Pair
from prime_composer.trainer.forward import forward_micro_batch
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.step import train_step

SEQ_LEN = 96
TEMPERATURE = 0.7
PROMPTS = ["What is 2 + 3?", "Compute 7 * 6 please."]
REPLIES = [("5", 1.0, 1.5), ("It is 6", 0.0, -1.5), ("42", 1.0, 0.5), ("The answer is 13", 0.0, -0.5)]
"""Two groups of two: (reply, reward, advantage); the failed reply of each group gets a hint."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))


def _model() -> Any:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        resolve_model_name("builtin:tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa"
    )


def _samples(tokenizer: Any) -> list[Sample]:
    samples = []
    for i, (reply, reward, advantage) in enumerate(REPLIES):
        messages = [{"role": "user", "content": PROMPTS[i // 2]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        completion = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
        samples.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[0.0] * len(completion),
                completion_mask=[1] * len(completion),
                reward=reward,
                example_id=i // 2,
                group_id=i // 2,
                policy_step=0,
                advantage=advantage,
                episode=EpisodeRecord(messages=[*messages, {"role": "assistant", "content": reply}]),
            )
        )
    builder = HintBuilder(HintConfig(enabled=True, sources=["sibling"]), tokenizer, SEQ_LEN)
    stats = asyncio.run(builder.apply(samples))
    assert stats.num_hinted == 2, stats  # the failed reply of each group
    return samples


def _pairs(tokenizer: Any, samples: list[Sample]) -> list[Pair]:
    pairs = []
    for i, (chosen, rejected) in enumerate([("5", "six"), ("42", "forty"), ("yes", "no thanks")]):
        c = [*tokenizer.encode(chosen, add_special_tokens=False), tokenizer.eos_token_id]
        r = [*tokenizer.encode(rejected, add_special_tokens=False), tokenizer.eos_token_id]
        pairs.append(
            Pair(
                cursor=i + 1,
                trace_id=f"t{i}",
                turn_index=0,
                state_hash=f"h{i}",
                context_ids=samples[2 * (i % 2)].prompt_ids,
                chosen_ids=c,
                rejected_ids=r,
                ref_chosen_logprobs=[-2.0 - 0.1 * k for k in range(len(c))],
                ref_rejected_logprobs=[-1.5] * len(r),
                label_smoothing=0.1 * i,
                vote_share=1.0,
                margin=1.0,
                process_reward=0.0,
                chosen_source="teacher",
                chosen_text=chosen,
                rejected_text=rejected,
                reference_model="tiny",
                provenance={},
            )
        )
    return pairs


def _loss_config(alpha: float, beta: float) -> LossConfig:
    return LossConfig.model_validate(
        {
            "rl": {"aggregation": "token_mean", "eps_low": 0.2, "eps_high": 0.28},
            "sdpo": {"weight": alpha, "beta": 0.5, "teacher": "ema"},
            "replay": {"weight": beta, "beta": 0.2, "loss_type": "sigmoid"},
        }
    )


def _ours(
    samples: list[Sample], pairs: list[Pair], alpha: float, beta: float
) -> tuple[float, dict[str, Any], list[torch.Tensor]]:
    """Our trainer's step: loss, gradients, and each sample's old logprobs (the model's own, as
    TRL's are with ``num_iterations = 1``; float32 on the wire, so TRL gets the same values)."""
    model = _model()
    (mbs,), _ = pack_step(
        samples, SEQ_LEN, 8, 1, pad_token_id=0, temperature=TEMPERATURE,
        packers=[SDPOPacker(), ReplayPacker()], extras={"replay": list(pairs)},
    )  # fmt: skip
    with torch.no_grad():
        for mb in mbs:
            mb.inference_logprobs = forward_micro_batch(model, mb).logprobs.float()
    terms = build_terms(_loss_config(alpha, beta), TermContext(model))
    assert [t.name for t in terms] == ["rl"] + ["sdpo"] * (alpha > 0) + ["replay"] * (beta > 0)
    result = train_step(model, mbs, terms, torch.device("cpu"))
    old = [
        torch.cat([mb.inference_logprobs[(mb.sample_ids == i) & mb.loss_mask] for mb in mbs]).double()
        for i in range(len(samples))
    ]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(result.loss), grads, old


def _trl_inputs(
    tokenizer: Any, samples: list[Sample], pairs: list[Pair], old: list[torch.Tensor]
) -> dict[str, Any]:
    """The batch dict TRL's ``_generate_and_score_completions`` returns, plus the channel lists."""
    pad = tokenizer.pad_token_id
    width_p = max(len(s.prompt_ids) for s in samples)
    width_c = max(len(s.completion_ids) for s in samples)
    prompt_ids = torch.full((len(samples), width_p), pad, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.full((len(samples), width_c), pad, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    old_logps = torch.zeros((len(samples), width_c), dtype=torch.float64)
    for i, s in enumerate(samples):
        old_logps[i, : len(s.completion_ids)] = old[i]
        prompt_ids[i, width_p - len(s.prompt_ids) :] = torch.tensor(s.prompt_ids)
        prompt_mask[i, width_p - len(s.prompt_ids) :] = 1
        completion_ids[i, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        completion_mask[i, : len(s.completion_ids)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float64),
        "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": old_logps,
        "channel_samples": samples,
        "channel_pairs": deal(pairs, len(samples)),
    }


def _trainer(tmp_path: Path, tokenizer: Any, channels: TRLChannels) -> ChannelGRPOTrainer:
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28,
        temperature=TEMPERATURE, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    return ChannelGRPOTrainer(
        model=_model(), reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
        train_dataset=data, processing_class=tokenizer, channels=channels,
    )  # fmt: skip


class _Pairs:
    def __init__(self, pairs: list[Pair]) -> None:
        self.pairs = pairs
        self.calls = 0

    async def take(self, step: int) -> list[Any]:
        self.calls += 1
        return list(self.pairs)


@pytest.mark.parametrize(("alpha", "beta"), [(0.5, 0.3), (0.0, 0.3), (0.5, 0.0), (0.0, 0.0)])
def test_trl_trainer_matches_our_step(tmp_path: Path, tokenizer: Any, alpha: float, beta: float) -> None:
    samples = _samples(tokenizer)
    pairs = _pairs(tokenizer, samples)
    ours_loss, ours_grads, old = _ours(samples, pairs, alpha, beta)

    source = _Pairs(pairs)
    channels = TRLChannels(
        loss=_loss_config(alpha, beta).model_copy(update={"rl": LossConfig().rl}),
        hints=HintConfig(enabled=True, sources=["sibling"]), pairs=source, seq_len=SEQ_LEN,
    )  # fmt: skip
    trainer = _trainer(tmp_path, tokenizer, channels)
    names = [t.name for t in trainer.channel_terms]
    assert names == ["sdpo"] * (alpha > 0) + ["replay"] * (beta > 0)
    # Weight 0 costs nothing: no teacher copy (so no teacher forward), no hint builder.
    assert ("ema" in trainer.term_context.copies) == (alpha > 0)
    assert (trainer.hints is not None) == (alpha > 0)
    model = trainer.model
    model.train()
    inputs = _trl_inputs(tokenizer, samples, pairs, old)
    trainer._buffered_inputs = [inputs]
    trainer._step = 0
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    # train_step sums the step's loss in float32; the gradients stay float64 end to end.
    assert float(loss.detach()) == pytest.approx(ours_loss, rel=1e-6)
    assert grads.keys() == ours_grads.keys()
    worst = max(
        float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in ours_grads.items()
    )
    print(
        f"trl-vs-ours alpha={alpha} beta={beta}: loss rel {abs(float(loss.detach()) / ours_loss - 1):.1e}, "
        f"worst grad rel {worst:.1e}"
    )
    # TRL's fused head and ours round differently (one of them at float32 inside a float64 model):
    # about 6e-7 of the largest gradient entry, the same with and without the channel terms.
    assert worst < 2e-6, worst
    if alpha > 0:
        teacher = trainer.term_context.copies["ema"]
        assert teacher.num_forwards == 1  # one micro-batch with hinted samples
    logged = trainer._metrics["train"]
    if beta > 0:
        assert logged["replay/num_pairs"] == [3.0]
        assert logged["loss/replay"][0] > 0
    assert ("loss/sdpo" in logged) == (alpha > 0)


def test_teacher_copy_runs_its_own_weights(tmp_path: Path, tokenizer: Any) -> None:
    """TRL patches the policy's ``forward`` with a closure over the policy; the teacher copy must
    not keep that closure (it would score with the policy's weights)."""
    channels = TRLChannels(
        loss=LossConfig.model_validate({"sdpo": {"weight": 1.0, "teacher": "frozen"}}),
        hints=HintConfig(enabled=True, sources=["sibling"]), seq_len=SEQ_LEN,
    )  # fmt: skip
    trainer = _trainer(tmp_path, tokenizer, channels)
    teacher = trainer.term_context.copies["frozen"].module
    ids = torch.tensor([[5, 6, 7, 8]])
    before = teacher(ids).logits.clone()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)
    assert torch.equal(teacher(ids).logits, before)


def test_bad_channel_configs_are_refused(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"needs TRLChannels\.hints"):
        _trainer(tmp_path, tokenizer, TRLChannels(loss=_loss_config(0.5, 0.0)))
    with pytest.raises(ValueError, match=r"needs TRLChannels\.pairs"):
        _trainer(tmp_path, tokenizer, TRLChannels(loss=_loss_config(0.0, 0.5)))
    with pytest.raises(ValueError, match=r"loss\.rl is not used"):
        _trainer(tmp_path, tokenizer, TRLChannels(loss=LossConfig.model_validate({"rl": {"kl_coef": 0.1}})))


@pytest.mark.slow  # ~35 s of CPU: TRL generates with the tiny model
def test_example_script_trains(tmp_path: Path) -> None:
    """``examples/trl_sdpo_replay.py`` runs a step: failed rollouts get hints, and the replay loss
    starts at log 2 (the pairs' reference is the initial policy, scored by ``ReferenceScorer``)."""
    script = Path(__file__).resolve().parents[2] / "examples" / "trl_sdpo_replay.py"
    done = subprocess.run(
        [sys.executable, str(script), "--max-steps", "1", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{'step': 1,")]
    (first,) = records
    assert first["sdpo/num_hinted"] >= 1
    assert first["loss/sdpo"] > 0
    assert first["loss/replay"] == pytest.approx(math.log(2), abs=1e-4)

"""A TRL GRPO run with our SDPO and replay channels added: ``ChannelGRPOTrainer`` on CPU.

    uv run python examples/trl_sdpo_replay.py --max-steps 2

TRL generates, rewards and computes its own GRPO loss; the trainer adds alpha * SDPO (failed
rollouts distilled from a teacher that sees a hint: here a sibling's successful reply, by the
project's hint builder) and beta * DPO on replay pairs (here a fixed set, scored once by the
project's ``ReferenceScorer``; in a real run ``orchestrator.replay.source.PairSource`` reads the
teacher service's store). The tiny model is built offline (``builtin:tiny-qwen3``), so the reward
is a toy one (a short reply wins) that gives every group a success and a failure.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from prime_composer.config.base import ModelConfig
from prime_composer.config.loss import LossConfig
from prime_composer.config.sdpo import HintConfig
from prime_composer.config.teacher import ReferenceConfig
from prime_composer.integrations.trl import ChannelGRPOTrainer, TRLChannels
from prime_composer.model.resolve import resolve_model_name
from prime_composer.teacher.pairs import Pair
from prime_composer.teacher.reference import ReferenceScorer

PROMPTS = ["What is 2 + 3?", "What is 7 * 6?", "What is 9 - 4?", "What is 8 / 2?"]
PAIRS = [("What is 2 + 3?", "5", "6"), ("What is 7 * 6?", "42", "41"), ("What is 9 - 4?", "5", "13")]


class FixedPairs:
    """A pair source with the same pairs every step (``PairSource`` has this ``take``)."""

    def __init__(self, pairs: list[Pair]) -> None:
        self.pairs = pairs

    async def take(self, step: int) -> list[Any]:
        return list(self.pairs)


def fixed_pairs(model_name: str) -> FixedPairs:
    scorer = ReferenceScorer(ModelConfig(name=model_name, dtype="float32"), ReferenceConfig())
    pairs = []
    for i, (question, chosen, rejected) in enumerate(PAIRS):
        context = scorer.context_ids([{"role": "user", "content": question}])
        c, r = scorer.completion_ids(chosen), scorer.completion_ids(rejected)
        ref_c, ref_r = scorer.score([(context, c), (context, r)])
        pairs.append(
            Pair(
                cursor=i + 1,
                trace_id=f"example-{i}",
                turn_index=0,
                state_hash=str(i),
                context_ids=context,
                chosen_ids=c,
                rejected_ids=r,
                ref_chosen_logprobs=ref_c,
                ref_rejected_logprobs=ref_r,
                label_smoothing=0.0,
                vote_share=1.0,
                margin=1.0,
                process_reward=0.0,
                chosen_source="teacher",
                chosen_text=chosen,
                rejected_text=rejected,
                reference_model=model_name,
                provenance={},
            )
        )
    return FixedPairs(pairs)


def short_reply_wins(completions: list[Any], **_: Any) -> list[float]:
    """1 for the shorter reply of each pair of generations, 0 for the other (a toy reward)."""
    lengths = [len(c[-1]["content"]) for c in completions]
    return [float(lengths[i] <= lengths[i ^ 1]) if i ^ 1 < len(lengths) else 0.0 for i in range(len(lengths))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the SDPO term")
    parser.add_argument("--beta", type=float, default=0.1, help="weight of the replay (DPO) term")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args()

    name = resolve_model_name("builtin:tiny-qwen3")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="sdpa")
    channels = TRLChannels(
        loss=LossConfig.model_validate(
            {"sdpo": {"weight": args.alpha, "teacher": "ema"}, "replay": {"weight": args.beta}}
        ),
        hints=HintConfig(enabled=True, sources=["sibling"]),
        pairs=fixed_pairs(name) if args.beta > 0 else None,
        seq_len=128,
    )
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl-sdpo-replay-")
    config = GRPOConfig(
        output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=12, loss_type="dapo", beta=0.0, learning_rate=1e-4,
        report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    trainer = ChannelGRPOTrainer(
        model=model, reward_funcs=[short_reply_wins], args=config, train_dataset=data,
        processing_class=tokenizer, channels=channels,
    )  # fmt: skip
    trainer.train()
    for record in trainer.state.log_history:
        shown = {
            k: record[k]
            for k in ("step", "loss", "loss/sdpo", "loss/replay", "sdpo/num_hinted")
            if k in record
        }
        print(shown)


if __name__ == "__main__":
    main()

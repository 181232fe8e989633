"""The ``sft`` command: assistant-token masks, data errors, the loss, training and exact resume."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from prime_composer.config.base import CheckpointConfig, ModelConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.config.sft import SFTConfig
from prime_composer.metrics import read_metrics
from prime_composer.trainer.checkpoint import latest_complete_step
from prime_composer.trainer.model import World, load_model
from prime_composer.trainer.sft import rank_micro_batches, run_sft, sft_dir, token_loss_sum, train_step
from prime_composer.trainer.sft_data import (
    batch_indices,
    collate,
    load_sft_samples,
    read_conversations,
    tokenize_conversation,
)

TINY = ModelConfig(name="builtin:tiny-qwen3", dtype="float32")
WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model(TINY, torch.device("cpu"))


def _arithmetic_chats(path: Path, num: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(num):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            messages = [
                {"role": "user", "content": f"What is {a} + {b}? Answer with only the number."},
                {"role": "assistant", "content": str(a + b)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def test_mask_is_exactly_the_assistant_tokens(tiny):
    _, tokenizer = tiny
    messages = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "The answer is 5"},
        {"role": "user", "content": "Think step by step"},
        {"role": "assistant", "content": "2 plus 3 is 5"},
    ]
    # The ChatML text written out by hand, cut where trained and untrained tokens meet. Each
    # piece starts or ends at a special token or newline, so encoding the pieces separately
    # gives the same tokens as encoding the whole.
    pieces = [
        ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n", False),
        ("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n", False),
        ("The answer is 5<|im_end|>", True),
        ("\n<|im_start|>user\nThink step by step<|im_end|>\n<|im_start|>assistant\n", False),
        ("2 plus 3 is 5<|im_end|>", True),
        ("\n", False),
    ]
    expected_ids, expected_mask = [], []
    for text, trained in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected_ids += ids
        expected_mask += [trained] * len(ids)

    sample = tokenize_conversation(messages, tokenizer)
    assert sample.input_ids == expected_ids
    assert sample.loss_mask == expected_mask
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert tokenizer.decode(trained) == "The answer is 5<|im_end|>2 plus 3 is 5<|im_end|>"


def test_assistant_first_and_rewriting_templates_are_errors(tiny):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match=r"messages\[0\] is an assistant turn"):
        tokenize_conversation([{"role": "assistant", "content": "hi"}], tokenizer)

    class RewritingTokenizer:  # a template that drops earlier turns' content
        is_fast = True
        eos_token_id = tokenizer.eos_token_id

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            last = messages[-1]["content"] if messages else ""
            return f"{len(messages)}:{last}" + ("|" if add_generation_prompt else "")

        def __call__(self, text, **kwargs):
            return tokenizer(text, **kwargs)

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(ValueError, match=r"does not render messages\[1\] \(assistant\) as an extension"):
        tokenize_conversation(msgs, RewritingTokenizer())


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": [{"role": "user", "content": "x"}', "not valid JSON"),
        ('{"conversation": []}', 'non-empty "messages" list'),
        ('{"messages": [{"role": "user", "content": 3}]}', r'messages\[0\] must have a string "role"'),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ],
)
def test_data_errors_name_file_and_line(tmp_path, line, message):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "chats.jsonl"
    path.write_text(f"{good}\n\n{line}\n")  # a blank line is skipped but still counted
    with pytest.raises(ValueError, match=rf"chats\.jsonl:3: .*{message}"):
        read_conversations(path)


def test_missing_file_and_truncation(tmp_path, tiny):
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="no such file"):
        read_conversations(tmp_path / "absent.jsonl")
    path = _arithmetic_chats(tmp_path / "c.jsonl", 3)
    # The prompt alone is longer than 8 tokens: nothing trainable is left.
    with pytest.raises(ValueError, match="no conversation has an assistant token within seq_len = 8"):
        load_sft_samples(path, tokenizer, seq_len=8)
    full = load_sft_samples(path, tokenizer, seq_len=512)
    cut = load_sft_samples(path, tokenizer, seq_len=len(full[0].input_ids) - 1)
    assert len(cut[0].input_ids) == len(full[0].input_ids) - 1


def test_batch_indices_cover_each_epoch_once():
    seen = [i for step in range(5) for i in batch_indices(step, batch_size=4, num_samples=10, seed=3)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]  # a new order each epoch
    assert batch_indices(2, 4, 10, seed=3) == seen[8:12]  # a pure function of the step


def test_token_loss_sum_matches_hf_loss_one_sample_at_a_time(tmp_path, tiny):
    model, tokenizer = tiny
    samples = load_sft_samples(_arithmetic_chats(tmp_path / "c.jsonl", 3, seed=5), tokenizer, 512)
    samples[1] = type(samples[1])(
        [*samples[1].input_ids, 7, 8, 9], [*samples[1].loss_mask, False, False, False]
    )
    with torch.no_grad():
        got = token_loss_sum(model, collate(samples, tokenizer.pad_token_id), torch.device("cpu"))
        expected = 0.0
        for s in samples:  # transformers' own loss: mean over labels != -100, no padding involved
            ids = torch.tensor([s.input_ids])
            labels = torch.where(torch.tensor([s.loss_mask]), ids, torch.full_like(ids, -100))
            expected += model(input_ids=ids, labels=labels).loss.item() * sum(s.loss_mask)
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_label_smoothing_is_the_mixture_of_target_and_uniform_cross_entropy(tmp_path, tiny):
    # Smoothed CE = (1 - eps) * (-log p_target) + eps * mean over the vocabulary of (-log p_v),
    # computed here by hand from one full forward per sample.
    model, tokenizer = tiny
    samples = load_sft_samples(_arithmetic_chats(tmp_path / "c.jsonl", 2, seed=3), tokenizer, 512)
    eps = 0.3
    with torch.no_grad():
        got = token_loss_sum(model, collate(samples, tokenizer.pad_token_id), torch.device("cpu"), eps)
        expected = 0.0
        for s in samples:
            log_p = model(input_ids=torch.tensor([s.input_ids])).logits[0].double().log_softmax(-1)
            for t in range(1, len(s.input_ids)):
                if s.loss_mask[t]:
                    row = log_p[t - 1]
                    expected += -(1 - eps) * row[s.input_ids[t]].item() - eps * row.mean().item()
    assert got.item() == pytest.approx(expected, rel=1e-5)


def test_micro_batching_does_not_change_the_update(tmp_path, tiny):
    _, tokenizer = tiny
    samples = load_sft_samples(_arithmetic_chats(tmp_path / "c.jsonl", 8, seed=7), tokenizer, 512)
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)
    updates = []
    for micro in (8, 3):  # one micro-batch of 8, or 3 + 3 + 2
        model, _ = load_model(TINY, torch.device("cpu"))
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        # Plain SGD with lr 1: the update is the gradient itself (Adam's first step would be
        # ~lr * sign(grad), which turns rounding noise on near-zero gradients into big flips).
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        batches = rank_micro_batches(samples, WORLD, micro, tokenizer.pad_token_id)
        metrics = train_step(model, optimizer, scheduler, batches, num_loss_tokens, WORLD, max_grad_norm=0.0)
        updates.append(before - torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert metrics["skipped"] == 0.0
    assert updates[0].abs().max() > 1e-3
    torch.testing.assert_close(updates[0], updates[1], rtol=0, atol=1e-6)


def _config(tmp_path: Path, data: Path, out: str, max_steps: int, **ckpt) -> SFTConfig:
    return SFTConfig(
        model=TINY,
        output_dir=tmp_path / out,
        data=data,
        max_steps=max_steps,
        batch_size=16,
        micro_batch_size=8,
        seq_len=64,
        optim=OptimConfig(lr=3e-3, weight_decay=0.0, max_grad_norm=1.0),
        ckpt=CheckpointConfig(**ckpt),
    )


def test_sft_learns_exports_and_resumes_exactly(tmp_path):
    torch.set_num_threads(1)
    data = _arithmetic_chats(tmp_path / "train.jsonl", 64)

    straight = _config(tmp_path, data, "a", max_steps=8)
    assert run_sft(straight) == 0
    records = read_metrics(straight.output_dir / "metrics" / "sft.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert {"loss", "lr", "perf/tokens_per_s", "grad_norm"} <= records[0].keys()
    losses = [r["loss"] for r in records]
    assert sum(losses[-2:]) / 2 < 0.75 * losses[0], losses

    final = sft_dir(straight.output_dir) / "final"
    assert (final / "tokenizer_config.json").is_file()
    assert not list(final.parent.glob(".tmp-*"))

    # 4 steps, stop; then resume to 8: the same weights as 8 steps straight.
    assert run_sft(_config(tmp_path, data, "b", max_steps=4)) == 0
    assert latest_complete_step(sft_dir(tmp_path / "b") / "checkpoints") == 4
    resumed = _config(tmp_path, data, "b", max_steps=8, resume=True)
    assert run_sft(resumed) == 0
    assert [r["step"] for r in read_metrics(resumed.output_dir / "metrics" / "sft.jsonl")] == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
    ]

    model_a, _ = load_model(ModelConfig(name=str(final)), torch.device("cpu"))
    model_b, _ = load_model(ModelConfig(name=str(sft_dir(resumed.output_dir) / "final")), torch.device("cpu"))
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert model_a.config.tie_word_embeddings and model_a.lm_head.weight is model_a.model.embed_tokens.weight


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    data = _arithmetic_chats(tmp_path / "train.jsonl", 16)
    with pytest.raises(ValueError, match="no complete trainer checkpoint"):
        run_sft(_config(tmp_path, data, "c", max_steps=2, resume=True))

"""A fourth channel added as a plugin (``entropy_bonus/``, beside this file) without editing any
file of the package: its config sections parse, resolve and round-trip, its orchestrator part
and packer put its group on the wire, its term trains, and its metric shows in the progress
line and the report.

The loss is checked against plain unpacked forwards of the model on each marked sample: the
entropy of the softmax at the sampling temperature of every distribution that predicts a
completion token, summed and divided by the number of such tokens, negated.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from entropy_bonus.spec import NAME, SPEC, EntropyBonusConfig, EntropyBonusLossConfig
from transformers import AutoModelForCausalLM

from prime_composer.config.channels import register_channel, unregister_channel
from prime_composer.config.errors import ConfigError
from prime_composer.config.resolve import resolve_rl_config
from prime_composer.config.trainer import TrainerConfig
from prime_composer.launch.progress import Progress
from prime_composer.model.resolve import resolve_model_name
from prime_composer.orchestrator.channel import ChannelContext, build_channels
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.report import panels, summary
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.step import train_step
from prime_composer.transport.batch import decode_rank_batch, encode_rank_batch

TEMPERATURE = 0.8
SEQ_LEN = 40


@pytest.fixture
def plugin() -> Iterator[None]:
    register_channel(SPEC)
    yield
    unregister_channel(NAME)


def _config(tmp_path: Path, body: str, *overrides: str):
    path = tmp_path / "run.toml"
    path.write_text(body)
    config, _ = resolve_rl_config(["@", str(path), *overrides])
    return config


ON = f"""
[orchestrator.sampling]
temperature = {TEMPERATURE}
[orchestrator.{NAME}]
enabled = true
max_reward = 0.5
[trainer.loss.{NAME}]
weight = 0.25
"""


def test_sections_parse_resolve_and_round_trip(plugin: None, tmp_path: Path) -> None:
    config = _config(tmp_path, ON)
    assert config.trainer.loss.section(NAME) == EntropyBonusLossConfig(weight=0.25)
    assert config.orchestrator.section(NAME) == EntropyBonusConfig(enabled=True, max_reward=0.5)
    # The resolved trainer config each process reads keeps the section.
    again = TrainerConfig.model_validate_json(config.trainer.model_dump_json())
    assert again.loss.section(NAME) == EntropyBonusLossConfig(weight=0.25)
    # The generic pairing check names the plugin's keys.
    with pytest.raises(ConfigError, match=rf"orchestrator\.{NAME}\.enabled = false"):
        _config(tmp_path, f"[trainer.loss.{NAME}]\nweight = 0.1\n")
    with pytest.raises(ConfigError, match=rf"trainer\.loss\.{NAME}\.weight = 0\b"):
        _config(tmp_path, f"[orchestrator.{NAME}]\nenabled = true\n")
    # A bad value in a plugin section names it; other unknown keys are still errors.
    with pytest.raises(ConfigError, match=rf"{NAME}\.weight"):
        _config(tmp_path, f"[trainer.loss.{NAME}]\nweight = -1.0\n")
    with pytest.raises(ConfigError, match="entropy_bonsu"):
        _config(tmp_path, "[trainer.loss.entropy_bonsu]\nweight = 0.1\n")


def test_without_registration_the_section_is_an_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"trainer\.loss\.{NAME}\.weight = 0\.25 .*no equivalent"):
        _config(tmp_path, ON)


def _samples() -> list[Sample]:
    rng = random.Random(0)
    out = []
    for i in range(6):
        prompt = [rng.randint(3, 400) for _ in range(rng.randint(3, 8))]
        completion = [rng.randint(3, 400) for _ in range(rng.randint(3, 7))]
        mask = [1] * len(completion)
        mask[1] = 0  # a tool token: no loss, no bonus
        out.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[-1.0] * len(completion),
                completion_mask=mask,
                reward=float(i % 2),
                example_id=i,
                group_id=i // 2,
                policy_step=0,
                advantage=0.0,
            )
        )
    return out


def _expected_bonus(model: torch.nn.Module, samples: list[Sample]) -> float:
    entropies = []
    with torch.no_grad():
        for s in samples:
            if s.reward >= 0.5:
                continue
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model(ids).logits[0].double() / TEMPERATURE
            for j, m in enumerate(s.completion_mask):
                if m:
                    p = torch.softmax(logits[len(s.prompt_ids) + j - 1], dim=-1)
                    entropies.append(float(-(p * p.log()).sum()))
    return -sum(entropies) / len(entropies)


def test_toy_channel_packs_trains_and_shows(plugin: None, tmp_path: Path) -> None:
    config = _config(tmp_path, ON)
    parts = build_channels(config.orchestrator, ChannelContext(tokenizer=None))
    assert [p.name for p in parts] == [NAME]
    samples = _samples()
    items = asyncio.run(parts[0].take(0, samples))
    assert parts[0].metrics() == {"entropy_bonus/marked": 3}
    packers = [p.packer for p in parts if p.packer is not None]
    rank_batches, stats = pack_step(
        samples, SEQ_LEN, 2, 1, pad_token_id=0, temperature=TEMPERATURE, packers=packers, extras={NAME: items}
    )
    assert stats.metrics()["entropy_bonus/packed_samples"] == 3
    # Through the wire format, as the trainer receives it.
    _, _, mbs = decode_rank_batch(encode_rank_batch(0, 0, rank_batches[0]))
    assert any(NAME in mb.groups for mb in mbs)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_name("builtin:tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa"
    )
    terms = build_terms(config.trainer.loss, TermContext(model))
    assert [t.name for t in terms] == ["rl", NAME]
    result = train_step(model, mbs, terms, torch.device("cpu"))
    bonus = result.metrics[f"loss/{NAME}"]
    assert bonus == pytest.approx(_expected_bonus(model, samples), rel=1e-5)
    assert result.metrics["loss/rl"] == pytest.approx(0.0, abs=1e-12)  # zero advantages
    assert float(result.loss) == pytest.approx(0.25 * bonus, rel=1e-6)
    # The bonus has a gradient (entropy is not only a logged metric here).
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "trainer.jsonl").write_text(json.dumps({"step": 1, "time": 0.0, **result.metrics}) + "\n")
    _, shown = Progress(metrics, 3, live=False).values()
    assert shown[-1] == ("bonus", bonus)  # after the built-in channels' columns
    assert [p.label for p in panels()][-1] == "entropy bonus"
    assert "run:" in summary(tmp_path)

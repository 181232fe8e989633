"""``[[orchestrator.env]]``, sampling and rollout config models: validation and documentation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prime_composer.config.env import EnvConfig, RolloutConfig, SamplingConfig


def test_env_entry_defaults_and_label() -> None:
    entry = EnvConfig(id="arith", args={"max_operand": 5})
    assert entry.label == "arith"
    assert entry.eval_args is None and entry.ratio == 1.0
    assert EnvConfig(id="arith", name="easy").label == "easy"


def test_unknown_key_is_an_error() -> None:
    with pytest.raises(ValidationError, match="extra"):
        EnvConfig(id="arith", arg={"max_operand": 5})


def test_num_eval_examples_needs_eval_args() -> None:
    with pytest.raises(ValidationError, match="eval_args"):
        EnvConfig(id="arith", num_eval_examples=4)
    assert EnvConfig(id="arith", eval_args={"split": "eval"}, num_eval_examples=4).num_eval_examples == 4


def test_sampling_defaults_are_on_policy() -> None:
    sampling = SamplingConfig()
    assert (sampling.temperature, sampling.top_p, sampling.seed) == (1.0, 1.0, None)
    with pytest.raises(ValidationError):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValidationError):
        RolloutConfig(max_concurrent=0)


@pytest.mark.parametrize("model", [EnvConfig, SamplingConfig, RolloutConfig])
def test_every_field_is_documented(model: type) -> None:
    undocumented = [name for name, field in model.model_fields.items() if not field.description]
    assert undocumented == []

"""The weight format (transport/weights.py): publish -> load, checked with transformers' own loader."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prime_composer.model.resolve import resolve_model_name
from prime_composer.transport.weights import (
    STABLE_MARKER,
    latest_stable,
    load_weights,
    publish_weights,
)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = resolve_model_name("builtin:tiny-qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model


def _perturbed(model, seed: int):
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return copy.eval()


def test_published_step_loads_with_from_pretrained(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    _, base = tiny
    model = _perturbed(base, seed=1)
    path = publish_weights(model, model.config, tmp_path / "broadcasts", step=3)

    assert path == tmp_path / "broadcasts" / "step_3"
    assert (path / STABLE_MARKER).is_file()
    assert sorted(p.name for p in path.iterdir()) == [
        "MANIFEST.json",
        "STABLE",
        "config.json",
        "model.safetensors",
    ]
    # transformers' loader (independent of load_weights) reads it and computes the same logits.
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_tied_embedding_written_once_like_save_pretrained(tiny, tmp_path):
    from safetensors import safe_open

    _, model = tiny
    published = publish_weights(model, model.config, tmp_path, step=0)
    with safe_open(str(published / "model.safetensors"), "pt") as f:
        ours = set(f.keys())
    model.save_pretrained(tmp_path / "reference")
    with safe_open(str(tmp_path / "reference" / "model.safetensors"), "pt") as f:
        reference = set(f.keys())
    assert ours == reference
    assert "lm_head.weight" not in ours and "model.embed_tokens.weight" in ours


def test_state_dict_input_cast_and_config_dtype(tiny, tmp_path):
    _, model = tiny
    state_dict = {k: v.clone() for k, v in model.state_dict().items()}  # aliasing lost, as after FSDP gather
    path = publish_weights(state_dict, model.config, tmp_path, step=5, dtype=torch.bfloat16)
    loaded = load_weights(path)
    assert "lm_head.weight" not in loaded  # the config says the embeddings are tied
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    assert torch.equal(loaded["model.norm.weight"], state_dict["model.norm.weight"].to(torch.bfloat16))
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config


def test_load_refuses_incomplete_and_latest_stable_skips_it(tiny, tmp_path):
    _, model = tiny
    publish_weights(model, model.config, tmp_path, step=1)
    publish_weights(model, model.config, tmp_path, step=2)
    # step 4 is half-written: the marker comes last, so it has none yet.
    (tmp_path / "step_4").mkdir()
    (tmp_path / ".tmp-step_7-abc").mkdir()
    assert latest_stable(tmp_path) == (2, tmp_path / "step_2")
    with pytest.raises(FileNotFoundError, match="STABLE"):
        load_weights(tmp_path / "step_4")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(tmp_path / "step_9")
    assert latest_stable(tmp_path / "nothing-here") is None


def test_republish_replaces_the_step(tiny, tmp_path):
    _, model = tiny
    publish_weights(model, model.config, tmp_path, step=1)
    other = _perturbed(model, seed=2)
    publish_weights(other, other.config, tmp_path, step=1)
    loaded = load_weights(tmp_path / "step_1")
    assert torch.equal(loaded["model.norm.weight"], other.state_dict()["model.norm.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # no temp or stale dirs left

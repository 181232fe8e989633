"""LoRA on the tiny model: one trainer step against a hand-merged model, the adapter on the wire,
checkpoint round trip and the refusal of another base model, the final export, the config.

The independent computation: an unwrapped copy of the base model run with
``torch.func.functional_call`` on weights merged by hand, ``W0 + (alpha / r) * B @ A``, where ``A``
and ``B`` are leaf tensors; autograd through that merge gives the reference gradients of ``A``
and ``B``, which peft's layers must reproduce. peft's own ``merge_and_unload`` is checked against
the same hand merge for the logits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from prime_composer.config.base import ModelConfig
from prime_composer.config.errors import ConfigError
from prime_composer.config.loss import LossConfig
from prime_composer.config.optim import OptimConfig
from prime_composer.config.trainer import LoraConfig, TrainerConfig
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.sample import Sample
from prime_composer.trainer.checkpoint import CheckpointManager
from prime_composer.trainer.export import save_lora_directory
from prime_composer.trainer.lora import (
    adapter_config,
    adapter_state_dict,
    apply_lora,
    base_fingerprint,
    check_base,
    lora_record,
)
from prime_composer.trainer.losses.base import TermContext, build_terms
from prime_composer.trainer.model import World, load_model
from prime_composer.trainer.optim import build_optimizer
from prime_composer.trainer.step import train_step
from prime_composer.transport.adapter import load_adapter, merged_weights, publish_adapter
from prime_composer.transport.weights import ADAPTER_WEIGHTS_NAME, NonFiniteWeightsError, verify_published

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
LORA = LoraConfig(rank=4, alpha=12.0, target_modules=("q_proj", "v_proj", "down_proj"))
SCALE = 12.0 / 4


def _base() -> nn.Module:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    return model


def _lora_model(seed: int = 1) -> Any:
    """The tiny model with adapters whose B is not zero (as after some training), so that the
    gradient of A is not zero either."""
    model = apply_lora(_base(), LORA)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def _adapted(model: Any) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """``{"model.layers.0.self_attn.q_proj.weight": (A, B)}`` of a peft model's parameters."""
    params = dict(model.named_parameters())
    out = {}
    for name, param in params.items():
        if name.endswith(".lora_A.default.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
            out[f"{module}.weight"] = (param, params[name.replace("lora_A", "lora_B")])
    return out


class HandMerged(nn.Module):
    """``plain`` run with its adapted weights replaced by ``W0 + scale * B @ A`` (autograd through it)."""

    def __init__(self, plain: nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.plain = plain
        self.factors = factors
        self.config = plain.config

    def get_output_embeddings(self) -> nn.Module:
        return self.plain.get_output_embeddings()

    def forward(self, **kwargs: Any) -> Any:
        weights = dict(self.plain.named_parameters())
        merged = {key: weights[key] + SCALE * b @ a for key, (a, b) in self.factors.items()}
        return torch.func.functional_call(self.plain, merged, args=(), kwargs=kwargs)


def _samples(model: nn.Module) -> list[Sample]:
    """Four samples whose sampling logprobs are the model's own, shifted a little (ratios near 1)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(4):
        prompt = torch.randint(5, 400, (5 + i,), generator=gen).tolist()
        completion = torch.randint(5, 400, (4,), generator=gen).tolist()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[
                :, 0
            ]
        out.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[
                    v + 0.05 * (j - 1) for j, v in enumerate(logp[len(prompt) - 1 :].tolist())
                ],
                completion_mask=[1] * 4,
                reward=float(i % 2),
                advantage=(-1.0) ** i * (0.5 + 0.1 * i),
                example_id=i // 2,
                group_id=i // 2,
                policy_step=0,
            )
        )
    return out


def _step_loss(model: nn.Module, samples: list[Sample]) -> float:
    (micro_batches,), _ = pack_step(samples, seq_len=32, micro_batch_size=2, num_ranks=1, pad_token_id=0)
    terms = build_terms(LossConfig(), TermContext(model))
    return train_step(model, micro_batches, terms, torch.device("cpu")).loss.item()


def test_lora_step_loss_and_adapter_grads_match_a_hand_merged_model() -> None:
    model = _lora_model()
    plain = _base()  # the same base weights, never wrapped
    factors = {
        key: (a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_())
        for key, (a, b) in _adapted(model).items()
    }
    assert len(factors) == 3 * plain.config.num_hidden_layers
    samples = _samples(model)

    loss = _step_loss(model, samples)
    reference = HandMerged(plain, factors)
    for p in plain.parameters():
        p.requires_grad_(False)
    ref_loss = _step_loss(reference, samples)

    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert abs(loss) > 1e-3  # a loss that is really there
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if ".lora_" in n}  # only the adapter trains
    for key, (a, b) in _adapted(model).items():
        ref_a, ref_b = factors[key]
        assert ref_a.grad is not None and ref_a.grad.abs().max() > 0
        torch.testing.assert_close(a.grad, ref_a.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(b.grad, ref_b.grad, rtol=1e-4, atol=1e-7)


def test_peft_merge_and_our_merge_agree_with_the_hand_merge(tmp_path: Path) -> None:
    model = _lora_model()
    plain = _base()
    factors = {k: (a.detach(), b.detach()) for k, (a, b) in _adapted(model).items()}
    ids = torch.randint(5, plain.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = HandMerged(plain, factors)(input_ids=ids).logits
        peft_merged = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
        ours = copy.deepcopy(plain)
        ours.load_state_dict(
            {
                **ours.state_dict(),
                **merged_weights(
                    ours.state_dict(),
                    load_adapter(
                        publish_adapter(adapter_state_dict(model), adapter_config(model), tmp_path, 1)
                    ),
                ),
            }
        )
        assert (reference - plain(input_ids=ids).logits).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(peft_merged, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours(input_ids=ids).logits, reference, rtol=1e-5, atol=1e-5)


def test_published_adapter_is_small_verified_and_in_peft_format(tmp_path: Path) -> None:
    from peft import PeftModel

    model = _lora_model()
    path = publish_adapter(adapter_state_dict(model), adapter_config(model), tmp_path, 3)
    assert verify_published(path) == [ADAPTER_WEIGHTS_NAME]
    num_adapter = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
    num_base = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad)
    size = (path / ADAPTER_WEIGHTS_NAME).stat().st_size
    assert size < 4 * num_adapter + 16_384 and size < 4 * num_base / 5
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 12.0
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]

    # peft reads the directory as its own and computes the same function.
    loaded = PeftModel.from_pretrained(_base(), str(path))
    ids = torch.randint(5, 400, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)

    # a flipped byte is refused, as for whole weights
    data = bytearray((path / ADAPTER_WEIGHTS_NAME).read_bytes())
    data[-1] ^= 0xFF
    (path / ADAPTER_WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors"):
        load_adapter(path)


def test_non_finite_adapter_is_never_published(tmp_path: Path) -> None:
    model = _lora_model()
    state = adapter_state_dict(model)
    key = next(iter(state))
    state[key][0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match="lora_A"):
        publish_adapter(state, adapter_config(model), tmp_path, 1)
    assert not (tmp_path / "step_1").exists()


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(6))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def test_checkpoint_holds_adapter_and_optimizer_only_and_resumes_them(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    optim = OptimConfig(lr=1e-2)
    model = _lora_model(seed=1)
    optimizer, scheduler = build_optimizer(model, optim, 4)
    _one_step(model, optimizer, scheduler)
    manager = CheckpointManager(tmp_path, keep=2, world=WORLD)
    record = lora_record("builtin:tiny-qwen3", "abc", LORA)
    part = manager.save(1, model, optimizer, scheduler, extra={"lora": record})

    keys = dcp.FileSystemReader(str(part / "model_optim")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no frozen base weight saved

    fresh = _lora_model(seed=2)  # other adapter values: the load must overwrite them
    fresh_opt, fresh_sched = build_optimizer(fresh, optim, 4)
    assert manager.read_extra(1)["lora"] == record
    manager.load(1, fresh, fresh_opt, fresh_sched)
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    fresh_moments = [s["exp_avg"] for s in fresh_opt.state.values()]
    assert len(moments) == len(fresh_moments) == sum(1 for p in model.parameters() if p.requires_grad)
    for m, f in zip(moments, fresh_moments, strict=True):
        assert torch.equal(m, f)
    assert fresh_sched.state_dict()["last_epoch"] == 1


def test_resume_refuses_another_base_and_mismatched_modes() -> None:
    model = _base()
    saved = lora_record("builtin:tiny-qwen3", base_fingerprint(model), LORA)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    other = lora_record("builtin:tiny-qwen3", base_fingerprint(model), LORA)
    assert other["base_sha256"] != saved["base_sha256"]
    check_base(saved, dict(saved), "ckpt")  # the same base is fine
    with pytest.raises(ValueError, match="another base model"):
        check_base(saved, other, "ckpt")
    with pytest.raises(ValueError, match="full fine-tuning"):
        check_base(None, saved, "ckpt")
    with pytest.raises(ValueError, match="holds LoRA adapters"):
        check_base(saved, None, "ckpt")
    with pytest.raises(ValueError, match=r"trainer\.model\.lora\.rank"):
        check_base(saved, {**saved, "rank": 8}, "ckpt")


@pytest.mark.parametrize("kind", ["merged", "adapter"])
def test_final_export_merged_loads_as_plain_model_or_adapter_with_peft(tmp_path: Path, kind: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_composer.model.resolve import resolve_model_name

    model = _lora_model()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3"))
    out = save_lora_directory(model, tokenizer, tmp_path / "final", WORLD, merged=kind == "merged")
    if kind == "merged":
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert not any("lora" in k for k in loaded.state_dict())
    else:
        loaded = PeftModel.from_pretrained(_base(), str(out))
    AutoTokenizer.from_pretrained(out)  # the tokenizer goes with it
    ids = torch.randint(5, 400, (1, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_config_rejects_bad_lora_settings_with_the_key() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"model\.lora\.rank"):
        TrainerConfig.model_validate({"model": {"lora": {"rank": 0}}})
    with pytest.raises(ValidationError, match=r"model\.lora\.target_modules[\s\S]*lm_head"):
        TrainerConfig.model_validate({"model": {"lora": {"target_modules": ["lm_head"]}}})
    with pytest.raises(ValidationError, match=r"model\.lora\.dropout"):
        TrainerConfig.model_validate({"model": {"lora": {"dropout": 1.0}}})
    with pytest.raises(ValidationError, match="diloco"):
        TrainerConfig.model_validate({"model": {"lora": {}}, "diloco": {"enabled": True}})
    assert TrainerConfig.model_validate({"model": {"lora": {}}}).model.lora_enabled
    assert not TrainerConfig.model_validate({"model": {"lora": {"enabled": False}}}).model.lora_enabled
    assert not TrainerConfig().model.lora_enabled


def test_target_that_matches_nothing_names_the_key_and_the_layers() -> None:
    with pytest.raises(
        ConfigError, match=r"trainer\.model\.lora\.target_modules: 'qkv_proj' matches no module"
    ):
        apply_lora(_base(), LoraConfig(target_modules=("q_proj", "qkv_proj")))
    with pytest.raises(ConfigError, match="only linear layers"):
        apply_lora(_base(), LoraConfig(target_modules=("input_layernorm",)))


def test_rl_export_merges_a_lora_checkpoint_or_a_published_adapter(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from prime_composer.trainer.export import checkpoint_kind, to_hf_directory

    base_config = ModelConfig(name="builtin:tiny-qwen3", dtype="float32")
    model = _lora_model()
    optimizer, scheduler = build_optimizer(model, OptimConfig(), 2)
    record = lora_record(base_config.name, base_fingerprint(_base()), LORA)
    CheckpointManager(tmp_path / "ckpt", keep=1, world=WORLD).save(
        1, model, optimizer, scheduler, extra={"lora": record}
    )
    published = publish_adapter(adapter_state_dict(model), adapter_config(model), tmp_path / "broadcasts", 1)
    assert checkpoint_kind(published) == "adapter" and checkpoint_kind(tmp_path / "ckpt" / "step_1") == "dcp"

    ids = torch.randint(5, 400, (1, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    for name, source in (("from_ckpt", tmp_path / "ckpt" / "step_1"), ("from_adapter", published)):
        out = to_hf_directory(source, base_config, tmp_path / name)
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(exported(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

    # a LoRA checkpoint exported onto another base is refused
    other = tmp_path / "other-base"
    changed = _base()
    with torch.no_grad():
        changed.model.layers[0].mlp.up_proj.weight.mul_(1.01)
    changed.save_pretrained(other)
    from transformers import AutoTokenizer

    from prime_composer.model.resolve import resolve_model_name

    AutoTokenizer.from_pretrained(resolve_model_name("builtin:tiny-qwen3")).save_pretrained(other)
    with pytest.raises(ValueError, match="another base model"):
        to_hf_directory(tmp_path / "ckpt" / "step_1", ModelConfig(name=str(other)), tmp_path / "bad")

"""LoRA under FSDP2 on 2 CPU ranks (gloo) equals the same run in one unsharded process.

Two steps of the real ``Trainer`` with adapters (and a KL reference copy, built with its own
adapters and sharded like the policy): the losses and grad norms, the published adapter of each
step, the merged final export and the checkpoint (adapter and optimizer only, loaded back into one
process, so resharded) must agree with the unsharded run within float32 reduction noise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from prime_composer.trainer.model import World
from prime_composer.trainer.train import Trainer
from prime_composer.transport.adapter import load_adapter

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.slow  # the unsharded trainer run and the shared 2-rank launch: ~1 min on 2 cores


def _single(out: Path) -> dict:
    """The unsharded reference: ``lora_fsdp_worker.main`` in this process (no ``RANK`` in the
    environment: one process, no process group; its ``Trainer`` seeds torch itself)."""
    from lora_fsdp_worker import main

    main(out)
    return torch.load(out / "result.pt", weights_only=True)


def test_two_ranks_match_one_process(tmp_path: Path, two_rank_runs: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    sharded_dir = two_rank_runs("lora_fsdp")  # the 2-rank run, in two_rank_workers.py's torchrun
    sharded = torch.load(sharded_dir / "result.pt", weights_only=True)
    single = _single(tmp_path / "single")
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-7)
    assert sharded["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)
    assert single["grad_norms"][1] > 0

    for step in (1, 2):
        ours = load_adapter(sharded_dir / "run" / "broadcasts" / f"step_{step}")
        ref = load_adapter(tmp_path / "single" / "run" / "broadcasts" / f"step_{step}")
        assert ours.config["r"] == ref.config["r"] == 4
        assert ours.state_dict.keys() == ref.state_dict.keys()
        for key, tensor in ref.state_dict.items():
            torch.testing.assert_close(ours.state_dict[key], tensor, rtol=1e-4, atol=1e-6, msg=key)

    merged = AutoModelForCausalLM.from_pretrained(sharded_dir / "run" / "final").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "single" / "run" / "final").state_dict()
    assert merged.keys() == reference.keys()
    for key, tensor in reference.items():
        torch.testing.assert_close(merged[key], tensor, rtol=1e-4, atol=1e-6, msg=key)

    # The 2-rank checkpoint loads into one process: the same adapter as the unsharded run's.
    from lora_fsdp_worker import NUM_STEPS, config

    resumed = Trainer(config(sharded_dir), World(0, 1, 0, torch.device("cpu")))
    resumed.ckpt.load(NUM_STEPS, resumed.model, resumed.optimizer, resumed.scheduler)
    final = load_adapter(tmp_path / "single" / "run" / "broadcasts" / f"step_{NUM_STEPS}")
    from prime_composer.trainer.lora import adapter_state_dict

    for key, tensor in adapter_state_dict(resumed.model).items():
        torch.testing.assert_close(tensor, final.state_dict[key], rtol=1e-4, atol=1e-6, msg=key)

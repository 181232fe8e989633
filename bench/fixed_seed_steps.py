"""Fixed-seed trainer steps, to show that a change meant to keep the numerics keeps them.

Runs ``--steps`` optimizer steps (``train_step`` + clip + AdamW + the policy copies' update) of
``builtin:tiny-qwen3`` in float32 from seed 0 on three workloads built as the unit tests build
them: ``rl`` (packed rollouts of varied lengths, advantages of both signs, sampling logprobs off the
policy so the clip binds), ``sdpo`` (the same plus hinted samples, an EMA teacher, weight 0.5) and
``replay`` (rollouts plus DPO pairs in the replay group, weight 0.5). Each step's loss, per-term
losses and grad norm (as ``float.hex``) and the final weights go to ``--out`` (a JSON file and a
safetensors file beside it).

Compare the code before and after a change (the older tree from ``git archive``)::

    uv run python bench/fixed_seed_steps.py --out /tmp/new.json
    git archive <old-commit> src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src uv run python bench/fixed_seed_steps.py --out /tmp/old.json
    uv run python bench/fixed_seed_steps.py --compare /tmp/old.json /tmp/new.json

``--compare`` prints, per workload, whether every loss and every weight is bitwise equal, and
otherwise the largest relative difference of the losses and the largest absolute difference of
the weights; its last line is ``bitwise_equal=<workloads equal>/<workloads>``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from safetensors.torch import load_file, save_file

WORKLOADS = ("rl", "sdpo", "replay")
SEQ_LEN = 96
MICRO_BATCH_SIZE = 2


def _samples(rng: random.Random, num: int, vocab: int, hinted_every: int = 0) -> list[Any]:
    from prime_composer.orchestrator.sample import Sample
    from prime_composer.orchestrator.sdpo.target import set_sdpo_target

    out = []
    for i in range(num):
        prompt = [rng.randint(3, vocab - 1) for _ in range(rng.randint(4, 16))]
        completion = [rng.randint(3, vocab - 1) for _ in range(rng.randint(3, 24))]
        s = Sample(
            prompt_ids=prompt,
            completion_ids=completion,
            completion_logprobs=[-rng.uniform(4.0, 8.0) for _ in completion],
            completion_mask=[1] * len(completion),
            reward=float(i % 2),
            example_id=i // 4,
            group_id=i // 4,
            policy_step=0,
            advantage=rng.uniform(-1.0, 1.0),
        )
        if hinted_every and i % hinted_every == 0 and len(completion) >= 2:
            start = rng.randint(0, len(completion) - 2)
            hint = [rng.randint(3, vocab - 1) for _ in range(rng.randint(2, 6))]
            set_sdpo_target(s, (start, len(completion)), prompt + completion[:start] + hint)
        out.append(s)
    return out


def _pairs(rng: random.Random, num: int, vocab: int) -> list[Any]:
    from prime_composer.teacher.pairs import Pair

    pairs = []
    for cursor in range(num):
        chosen = [rng.randint(3, vocab - 1) for _ in range(rng.randint(2, 6))]
        rejected = [rng.randint(3, vocab - 1) for _ in range(rng.randint(2, 6))]
        pairs.append(
            Pair(
                cursor=cursor,
                trace_id=f"t{cursor}",
                turn_index=1,
                state_hash=f"s{cursor}",
                context_ids=[rng.randint(3, vocab - 1) for _ in range(rng.randint(3, 8))],
                chosen_ids=chosen,
                rejected_ids=rejected,
                ref_chosen_logprobs=[-rng.uniform(3, 7) for _ in chosen],
                ref_rejected_logprobs=[-rng.uniform(3, 7) for _ in rejected],
                label_smoothing=0.1,
                vote_share=0.9,
                margin=0.7,
                process_reward=-0.7,
                chosen_source="teacher",
                chosen_text="",
                rejected_text="",
                reference_model="tiny",
                provenance={},
            )
        )
    return pairs


def run(workload: str, num_steps: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from prime_composer.config.base import ModelConfig
    from prime_composer.config.loss import LossConfig
    from prime_composer.config.optim import OptimConfig
    from prime_composer.orchestrator.packing import pack_step
    from prime_composer.orchestrator.replay.packing import ReplayPacker
    from prime_composer.orchestrator.sdpo.packing import SDPOPacker
    from prime_composer.trainer.losses.base import TermContext, build_terms
    from prime_composer.trainer.model import load_model
    from prime_composer.trainer.optim import build_optimizer, clip_grad_norm
    from prime_composer.trainer.step import train_step

    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name="builtin:tiny-qwen3", dtype="float32"), torch.device("cpu"))
    vocab = model.config.vocab_size
    rng = random.Random(0)
    kwargs: dict[str, Any] = {}
    if workload == "rl":
        cfg = LossConfig()
        samples = _samples(rng, 24, vocab)
    elif workload == "sdpo":
        cfg = LossConfig(sdpo={"weight": 0.5, "teacher": "ema"})
        samples = _samples(rng, 24, vocab, hinted_every=3)
        kwargs = {"packers": [SDPOPacker()]}
    else:
        cfg = LossConfig(replay={"weight": 0.5})
        samples = _samples(rng, 16, vocab)
        kwargs = {"packers": [ReplayPacker()], "extras": {"replay": _pairs(rng, 6, vocab)}}
    (micro_batches,), _ = pack_step(samples, SEQ_LEN, MICRO_BATCH_SIZE, 1, 0, temperature=0.9, **kwargs)
    context = TermContext(model)
    terms = build_terms(cfg, context)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-3), 100)
    steps = []
    for _ in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        result = train_step(model, micro_batches, terms, torch.device("cpu"))
        grad_norm = clip_grad_norm(model, 1.0)
        optimizer.step()
        scheduler.step()
        context.after_optimizer_step()
        steps.append(
            {
                "loss": float(result.loss).hex(),
                "grad_norm": float(grad_norm).hex(),
                **{k: v.hex() for k, v in sorted(result.metrics.items()) if k.startswith("loss/")},
            }
        )
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    return {"steps": steps}, weights


def compare(old_path: Path, new_path: Path) -> None:
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    num_equal = 0
    for workload in WORKLOADS:
        a, b = old[workload]["steps"], new[workload]["steps"]
        rel = 0.0
        for sa, sb in zip(a, b, strict=True):
            for key in sa:
                x, y = float.fromhex(sa[key]), float.fromhex(sb[key])
                rel = max(rel, abs(x - y) / max(abs(x), 1e-30))
        wa = load_file(str(old_path.with_suffix(f".{workload}.safetensors")))
        wb = load_file(str(new_path.with_suffix(f".{workload}.safetensors")))
        weight_diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
        bitwise = a == b and all(torch.equal(wa[k], wb[k]) for k in wa)
        num_equal += bitwise
        print(
            f"{workload:>7}: {len(a)} steps, losses {'identical' if a == b else f'max rel diff {rel:.3e}'}, "
            f"weights {'identical' if bitwise else f'max abs diff {weight_diff:.3e}'}"
        )
    print(f"bitwise_equal={num_equal}/{len(WORKLOADS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file to write (weights beside it)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
        return
    if args.out is None:
        raise SystemExit("fixed_seed_steps: give --out FILE.json (or --compare OLD.json NEW.json)")
    torch.set_num_threads(1)
    record = {}
    for workload in WORKLOADS:
        record[workload], weights = run(workload, args.steps)
        save_file(weights, str(args.out.with_suffix(f".{workload}.safetensors")))
        print(f"{workload}: losses {[float.fromhex(s['loss']) for s in record[workload]['steps']]}")
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

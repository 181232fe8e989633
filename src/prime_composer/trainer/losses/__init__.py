"""Loss terms of the trainer, as pure functions of tensors.

Every term takes tensors plus its config section and the step's global denominator, and returns
``(loss, metrics)``: ``loss`` is this micro-batch's sum divided by that denominator, so the
micro-batch losses of a step add up to the step's loss whatever the split into micro-batches and
ranks; ``metrics`` are ``[sum, count]`` pairs reduced exactly by ``finalize_metrics``.

- ``rl.rl_loss``: clipped policy gradient (GRPO / DAPO / Dr. GRPO / GSPO), optional reference KL.
- ``sdpo.sdpo_loss``: generalized JSD from the hinted teacher to the student.
- ``logprobs``: per-token log-probabilities and entropies from logits, memory-efficiently.
- ``aggregate``: the global denominators and the metric reduction.
"""

from prime_composer.trainer.losses.aggregate import (
    accumulate_metrics,
    finalize_metrics,
    rl_normalizer,
    sequence_normalizer,
    token_normalizer,
)
from prime_composer.trainer.losses.logprobs import entropy_from_logits, token_entropy, token_logprobs
from prime_composer.trainer.losses.rl import rl_loss
from prime_composer.trainer.losses.sdpo import generalized_jsd, sdpo_loss

__all__ = [
    "accumulate_metrics",
    "entropy_from_logits",
    "finalize_metrics",
    "generalized_jsd",
    "rl_loss",
    "rl_normalizer",
    "sdpo_loss",
    "sequence_normalizer",
    "token_entropy",
    "token_logprobs",
    "token_normalizer",
]

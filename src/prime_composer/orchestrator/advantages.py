"""Group-relative advantages (GRPO / Dr. GRPO / DAPO options) and dynamic-sampling filtering.

For each group (one example x ``group_size`` rollouts):

    shaped_i    = reward_i + overlong_penalty(len(completion_i))      (DAPO, optional)
                           + w * process_reward_i                     (replay, optional)
    advantage_i = shaped_i - mean(shaped)                             (Dr. GRPO: no std)
    advantage_i = (shaped_i - mean(shaped)) / (std(shaped) + 1e-4)    (GRPO: ``std_scaling``)

``std`` is the sample standard deviation (n - 1 in the denominator), as in TRL's GRPO. A group
whose shaped rewards are all equal gets advantage exactly 0 (no floating-point residue), which
is what ``filter_zero_variance`` keys on to drop it (DAPO dynamic sampling).

``process_reward_i`` is the teachers' mean process reward over the rollout's labeled steps
(``replay/shaping.py``; in [-1, 1]) and ``w`` is ``process_reward_weight``; a rollout without one
(or ``w = 0``) adds nothing, and with ``w = 0`` the numerics are exactly those without shaping.

The unit is the episode: the Samples of one episode split at a history-rewriting chat template
(same ``episode.trace_id``) count once in the mean and std, with their first Sample's shaped
reward, and all get that episode's advantage.

Usage::

    scored = compute_advantages(samples, cfg.advantage, max_tokens=cfg.max_tokens)
    kept, num_dropped_groups = filter_zero_variance(scored)   # then sample more groups
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from prime_composer.config.advantage import AdvantageConfig
from prime_composer.orchestrator.sample import Sample

STD_EPS = 1e-4
"""Added to the group std before dividing, so a near-constant group does not explode."""


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment for a completion of ``num_tokens`` tokens.

    0 up to ``max_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at
    ``max_tokens``, and ``-penalty`` beyond.
    """
    start = max_tokens - buffer
    if buffer == 0 or num_tokens <= start:
        return 0.0
    return -penalty * min(num_tokens - start, buffer) / buffer


def _group_advantages(shaped: list[float], std_scaling: bool) -> list[float]:
    if all(r == shaped[0] for r in shaped):
        return [0.0] * len(shaped)
    mean = math.fsum(shaped) / len(shaped)
    centered = [r - mean for r in shaped]
    if not std_scaling:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / (len(shaped) - 1))
    return [c / (std + STD_EPS) for c in centered]


def compute_advantages(
    samples: list[Sample],
    cfg: AdvantageConfig,
    max_tokens: int | None = None,
    process_rewards: Sequence[float | None] | None = None,
) -> list[Sample]:
    """Return copies of ``samples`` (same order) with ``advantage`` set per group.

    ``max_tokens`` is the completion token budget the rollouts were sampled with; it is needed
    only for the overlong penalty (``cfg.overlong_buffer > 0``), whose value is then recorded in
    each sample's ``metrics["overlong_penalty"]``. ``process_rewards`` (one per sample, None where
    the teachers labeled none of its steps) is added with weight ``cfg.process_reward_weight``;
    a shaped sample records it in ``metrics["process_reward"]``. ``reward`` is left as the
    environment gave it.
    """
    if cfg.overlong_buffer > 0 and (max_tokens is None or cfg.overlong_buffer > max_tokens):
        raise ValueError(
            f"advantage.overlong_buffer = {cfg.overlong_buffer} needs the completion budget "
            f"max_tokens (got {max_tokens}) to be passed and at least as large as the buffer"
        )
    penalties = [
        overlong_penalty(len(s.completion_ids), max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        if cfg.overlong_buffer > 0 and max_tokens is not None
        else 0.0
        for s in samples
    ]

    weight = cfg.process_reward_weight
    if process_rewards is not None and len(process_rewards) != len(samples):
        raise ValueError(f"{len(process_rewards)} process rewards for {len(samples)} samples")
    if weight == 0 or process_rewards is None:
        process_rewards = [None] * len(samples)
    shaping = [weight * pr if pr is not None else 0.0 for pr in process_rewards]

    groups: dict[int, dict[object, list[int]]] = {}
    for i, s in enumerate(samples):
        episode = s.episode.trace_id if s.episode.trace_id is not None else ("sample", i)
        groups.setdefault(s.group_id, {}).setdefault(episode, []).append(i)
    advantages = [0.0] * len(samples)
    for episodes in groups.values():
        members = list(episodes.values())
        shaped = [samples[m[0]].reward + penalties[m[0]] + shaping[m[0]] for m in members]
        for indices, adv in zip(members, _group_advantages(shaped, cfg.std_scaling), strict=True):
            for i in indices:
                advantages[i] = adv

    out = []
    for s, adv, pen, pr in zip(samples, advantages, penalties, process_rewards, strict=True):
        metrics = {**s.metrics, "overlong_penalty": pen} if cfg.overlong_buffer > 0 else dict(s.metrics)
        if pr is not None:
            metrics["process_reward"] = pr
        out.append(replace(s, advantage=adv, metrics=metrics))
    return out


def filter_zero_variance(samples: list[Sample]) -> tuple[list[Sample], int]:
    """Drop groups whose advantages are all 0 (equal shaped rewards): they carry no gradient.

    Call after ``compute_advantages``. Returns ``(kept samples in order, number of groups dropped)``.
    """
    informative: dict[int, bool] = {}
    for s in samples:
        informative[s.group_id] = informative.get(s.group_id, False) or s.advantage != 0.0
    kept = [s for s in samples if informative[s.group_id]]
    return kept, sum(not v for v in informative.values())

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

**Per-step credit** (``process_reward_credit = "step"`` or ``"return"``; ``"potential"`` below). The process rewards judge
single steps (assistant turns), so they can credit the step they judge instead of the whole
rollout. The group advantage ``A_i`` is then computed from the outcome alone (reward + overlong
penalty), and each labeled turn k of rollout i gets its own advantage, carried token-exact to the
trainer (``Sample.turn_advantages`` -> ``Sample.token_advantages`` -> the packed per-token
advantages of ``rl_loss``):

    step:    A_ik = A_i + w * (p_ik - b_i)
    return:  A_ik = A_i + w * sum_{j >= k, j labeled} (p_ij - b_i)
    b_i      = mean over the group's other labeled rollouts e of mean_k p_ek  (0 if there is none)

A turn the teachers did not label keeps ``A_i`` (``step``) or the return of the later labeled
turns (``return``). This is PRIME's combination (Cui et al. 2025: outcome and process returns
computed separately, each against a leave-one-out baseline, then summed), with the teachers' vote
margin as the process reward instead of an implicit PRM's log-ratio, and undiscounted. Neither rule
is potential-based shaping: ``p`` scores an action at a state, not a state, so a large ``w`` can
move the optimum toward what the teachers would do; ``w`` should stay small next to the outcome's
spread.

**Potential-based credit** (``process_reward_credit = "potential"``, Ng et al. 1999). The state
``s_k`` before turn k is the whole history (task, tools, earlier turns: what ``Trace.state_hash``
hashes), so the teachers' judgment of any earlier step is a function of the state. The potential is

    Phi(s_k) = p_j of the latest labeled turn j < k of the episode (0 when there is none)
    Phi(s_T) = 0  once the episode has ended (after its last turn)
    F_k      = gamma * Phi(s_{k+1}) - Phi(s_k)          A_ik = A_i + w * F_k

so turn k is credited ``gamma * p_k`` for its own labeled action and pays back the credit of the
step before it. The shaping telescopes: ``sum_k gamma^k F_k = gamma^T Phi(s_T) - Phi(s_0) =
-Phi(s_0)``, a constant per prompt (here 0), so the shaped return of every episode equals the
unshaped one up to that constant and the optimal policy is unchanged, whatever ``w`` (the
``step``/``return`` rules give no such guarantee). No leave-one-out baseline is needed. Every turn
of a labeled episode gets a credit (an unlabeled one ``(gamma - 1) * Phi(s_k)``, 0 undiscounted);
the last turn's own judgment never counts, because the terminal potential must be 0.

With ``w = 0`` nothing is looked up and every Sample keeps ``turn_advantages = None``: the numerics
are exactly those without process rewards.

Usage::

    scored = compute_advantages(samples, cfg.advantage, max_tokens=cfg.max_tokens)
    kept, num_dropped_groups = filter_zero_variance(scored)   # then sample more groups
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace

from prime_composer.config.advantage import AdvantageConfig
from prime_composer.orchestrator.sample import ProcessReward, Sample, StepReward, TurnAdvantage

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
    process_rewards: Sequence[float | ProcessReward | None] | None = None,
) -> list[Sample]:
    """Return copies of ``samples`` (same order) with ``advantage`` set per group.

    ``max_tokens`` is the completion token budget the rollouts were sampled with; it is needed
    only for the overlong penalty (``cfg.overlong_buffer > 0``), whose value is then recorded in
    each sample's ``metrics["overlong_penalty"]``. ``process_rewards`` (one per sample, None where
    the teachers labeled none of its steps: a ``ProcessReward``, or for sequence credit its mean
    alone) is credited with weight ``cfg.process_reward_weight`` as ``cfg.process_reward_credit``
    says (module docstring); a shaped sample records its mean in ``metrics["process_reward"]`` and,
    with per-step credit, gets ``turn_advantages``. ``reward`` is left as the environment gave it.
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
    per_step = cfg.process_reward_credit != "sequence"
    if per_step and any(pr is not None and not isinstance(pr, ProcessReward) for pr in process_rewards):
        raise ValueError(
            f"advantage.process_reward_credit = {cfg.process_reward_credit!r} needs per-step process "
            "rewards (ProcessReward with steps), got a bare mean"
        )
    means = [pr.mean if isinstance(pr, ProcessReward) else pr for pr in process_rewards]
    shaping = [weight * m if m is not None and not per_step else 0.0 for m in means]

    groups: dict[int, dict[object, list[int]]] = {}
    for i, s in enumerate(samples):
        episode = s.episode.trace_id if s.episode.trace_id is not None else ("sample", i)
        groups.setdefault(s.group_id, {}).setdefault(episode, []).append(i)
    advantages = [0.0] * len(samples)
    turn_advantages: list[list[TurnAdvantage] | None] = [None] * len(samples)
    for episodes in groups.values():
        members = list(episodes.values())
        shaped = [samples[m[0]].reward + penalties[m[0]] + shaping[m[0]] for m in members]
        group_adv = _group_advantages(shaped, cfg.std_scaling)
        for indices, adv in zip(members, group_adv, strict=True):
            for i in indices:
                advantages[i] = adv
        if per_step:
            episode_means = [means[m[0]] for m in members]
            for e, (indices, adv) in enumerate(zip(members, group_adv, strict=True)):
                others = [m for f, m in enumerate(episode_means) if f != e and m is not None]
                baseline = math.fsum(others) / len(others) if others else 0.0
                episode_rewards = [process_rewards[i] for i in indices]
                if cfg.process_reward_credit == "potential":
                    credits = _potential_credits(episode_rewards, cfg.process_reward_gamma)
                else:
                    credits = _step_credits(episode_rewards, baseline, cfg.process_reward_credit == "return")
                for i, credit in zip(indices, credits, strict=True):
                    if credit is not None:
                        turn_advantages[i] = [TurnAdvantage(span, adv + weight * c) for span, c in credit]

    out = []
    for s, adv, turns, pen, mean in zip(samples, advantages, turn_advantages, penalties, means, strict=True):
        metrics = {**s.metrics, "overlong_penalty": pen} if cfg.overlong_buffer > 0 else dict(s.metrics)
        if mean is not None:
            metrics["process_reward"] = mean
        out.append(replace(s, advantage=adv, turn_advantages=turns, metrics=metrics))
    return out


def potential_shaping(potentials: Sequence[float], gamma: float) -> list[float]:
    """``F_k = gamma * Phi(s_{k+1}) - Phi(s_k)`` for k = 0..T-1, from ``potentials`` = Phi(s_0..s_T)."""
    return [gamma * after - before for before, after in itertools.pairwise(potentials)]


def _episode_steps(rewards: list[float | ProcessReward | None]) -> list[tuple[int, int, StepReward]]:
    """The episode's turns over its Samples as ``(turn index, Sample, step)``, in turn order."""
    return sorted(
        (
            (step.index, n, step)
            for n, pr in enumerate(rewards)
            if isinstance(pr, ProcessReward)
            for step in pr.steps
        ),
        key=lambda item: (item[0], item[1]),  # episode turn order; the Sample breaks a (malformed) tie
    )


def _potential_credits(
    rewards: list[float | ProcessReward | None], gamma: float
) -> list[list[tuple[tuple[int, int], float]] | None]:
    """As ``_step_credits``, with the potential-based rule (module docstring): every turn's
    ``(span, F_k)``."""
    steps = _episode_steps(rewards)
    potentials = [0.0]  # Phi(s_0): no step judged yet
    for _, _, step in steps[:-1]:
        potentials.append(step.reward if step.reward is not None else potentials[-1])
    potentials.append(0.0)  # Phi(s_T): the episode has ended
    shaping = potential_shaping(potentials, gamma) if steps else []
    credit = {(n, step.index): f for (_, n, step), f in zip(steps, shaping, strict=True)}
    return [
        [(step.span, credit[(n, step.index)]) for step in pr.steps] if isinstance(pr, ProcessReward) else None
        for n, pr in enumerate(rewards)
    ]


def _step_credits(
    rewards: list[float | ProcessReward | None], baseline: float, to_go: bool
) -> list[list[tuple[tuple[int, int], float]] | None]:
    """Per Sample of one episode: ``(span, credit)`` of each of its turns that gets a credit, where
    the credit is ``p_k - baseline`` (``to_go``: summed over the episode's turns from k on, labeled
    ones only); None for a Sample without process rewards."""
    steps = _episode_steps(rewards)
    credit = {(n, step.index): step.reward - baseline for _, n, step in steps if step.reward is not None}
    if to_go:
        running, seen = 0.0, False
        for _, n, step in reversed(steps):
            key = (n, step.index)
            seen = seen or key in credit
            running += credit.get(key, 0.0)
            if seen:  # a turn after the last labeled one has no return
                credit[key] = running
    out: list[list[tuple[tuple[int, int], float]] | None] = []
    for n, pr in enumerate(rewards):
        if not isinstance(pr, ProcessReward):
            out.append(None)
            continue
        out.append([(step.span, credit[(n, step.index)]) for step in pr.steps if (n, step.index) in credit])
    return out


def filter_zero_variance(samples: list[Sample]) -> tuple[list[Sample], int]:
    """Drop groups whose advantages are all 0 (equal shaped rewards and, with per-step credit, no
    turn credited): they carry no gradient.

    Call after ``compute_advantages``. Returns ``(kept samples in order, number of groups dropped)``.
    """
    informative: dict[int, bool] = {}
    for s in samples:
        nonzero = s.advantage != 0.0 or any(t.advantage != 0.0 for t in s.turn_advantages or ())
        informative[s.group_id] = informative.get(s.group_id, False) or nonzero
    kept = [s for s in samples if informative[s.group_id]]
    return kept, sum(not v for v in informative.values())

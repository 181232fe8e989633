"""Per-step process credit (``orchestrator.advantage.process_reward_credit = "step" | "return" |
"potential"``), the potential-based rule's telescoping identity by hand included:
the per-turn advantages against a hand computation, their way token by token into the packed batch,
the RL loss on them against a loop over tokens, the lookup against labels in a real store, and
weight 0 bitwise the computation without process rewards (loss and gradient, fixed seed)."""

from __future__ import annotations

import logging
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from prime_composer.config.advantage import AdvantageConfig
from prime_composer.config.loss import RLLossConfig
from prime_composer.config.teacher import TraceSourceConfig
from prime_composer.orchestrator.advantages import compute_advantages, filter_zero_variance, potential_shaping
from prime_composer.orchestrator.episode import TurnInfo
from prime_composer.orchestrator.packing import pack_step
from prime_composer.orchestrator.record import EpisodeRecord
from prime_composer.orchestrator.replay.shaping import ProcessRewards
from prime_composer.orchestrator.sample import ProcessReward, Sample, StepReward, TurnAdvantage
from prime_composer.orchestrator.trace_export import episode_trace
from prime_composer.teacher.actions import Action
from prime_composer.teacher.client import TeacherClient
from prime_composer.teacher.store import PlannedStep, TeacherStore
from prime_composer.teacher.traces import parse_trace
from prime_composer.trainer.losses.aggregate import rl_normalizer
from prime_composer.trainer.losses.rl import rl_loss

SPANS = ((0, 2), (4, 7))
"""Two assistant turns: completion tokens 0-1, then 2-3 (a user turn, mask 0), then 4-6."""


def two_turn(reward: float, answers: tuple[str, str], group_id: int = 0, trace_id: str = "t") -> Sample:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": answers[1]},
    ]
    turns = [
        TurnInfo(index=k, span=span, message_index=1 + 2 * k, finish_reason="stop")
        for k, span in enumerate(SPANS)
    ]
    return Sample(
        [1, 2, 3],
        [10, 11, 7, 8, 12, 13, 14],
        [-0.5, -0.25, 0.0, 0.0, -1.0, -0.125, -2.0],
        [1, 1, 0, 0, 1, 1, 1],
        reward,
        0,
        group_id,
        0,
        episode=EpisodeRecord(messages=messages, trace_id=trace_id, turns=turns),
    )


def rewards(mean: float, *steps: float | None) -> ProcessReward:
    return ProcessReward(mean, tuple(StepReward(k, SPANS[k], p) for k, p in enumerate(steps)))


GROUP = [two_turn(1.0, ("a", "b"), trace_id="A"), two_turn(0.0, ("c", "d"), trace_id="B")]
PROCESS = [rewards(0.25, 1.0, -0.5), rewards(-1 / 3, -1 / 3, None)]


def hand(credit: str) -> list[list[Fraction]]:
    """Per-token advantages of GROUP, derived by hand in exact arithmetic (w = 1/5)."""
    w = Fraction(1, 5)
    outcome_a, outcome_b = Fraction(1, 2), Fraction(-1, 2)  # rewards 1, 0; Dr. GRPO mean 1/2
    b_a, b_b = Fraction(-1, 3), Fraction(1, 4)  # leave-one-out: the other rollout's mean
    if credit == "step":
        a = [outcome_a + w * (1 - b_a), outcome_a + w * (Fraction(-1, 2) - b_a)]
        b = [outcome_b + w * (Fraction(-1, 3) - b_b), outcome_b]  # B's turn 1 is unlabeled
    else:  # return-to-go: turn 0 also gets turn 1's credit; B's turn 1 has no labeled turn after it
        a1 = Fraction(-1, 2) - b_a
        a = [outcome_a + w * ((1 - b_a) + a1), outcome_a + w * a1]
        b = [outcome_b + w * (Fraction(-1, 3) - b_b), outcome_b]
    z = Fraction(0)
    return [[a[0], a[0], z, z, a[1], a[1], a[1]], [b[0], b[0], z, z, b[1], b[1], b[1]]]


@pytest.mark.parametrize("credit", ["step", "return"])
def test_per_turn_advantages_match_the_hand_computation(credit: str) -> None:
    cfg = AdvantageConfig(process_reward_weight=0.2, process_reward_credit=credit)
    out = compute_advantages(GROUP, cfg, process_rewards=PROCESS)
    assert [s.advantage for s in out] == [0.5, -0.5]  # the outcome's advantage, unshaped
    assert [s.metrics["process_reward"] for s in out] == [0.25, -1 / 3]
    for sample, expected in zip(out, hand(credit), strict=True):
        assert sample.token_advantages() == pytest.approx([float(x) for x in expected], abs=1e-15)
    # An unlabeled turn is not listed: it keeps the rollout's advantage.
    assert [t.span for t in out[1].turn_advantages or []] == [(0, 2)]


def test_per_turn_advantages_go_token_exact_into_the_packed_batch() -> None:
    cfg = AdvantageConfig(process_reward_weight=0.2, process_reward_credit="step")
    out = compute_advantages(GROUP, cfg, process_rewards=PROCESS)
    (batches,), _ = pack_step(out, seq_len=10, micro_batch_size=2, num_ranks=1, pad_token_id=0)
    (mb,) = batches
    for sample_id, expected in enumerate(hand("step")):
        where = (mb.sample_ids == sample_id).nonzero()
        row, start = int(where[0, 0]), int(where[0, 1])
        prompt = mb.advantages[row, start : start + 3]
        completion = mb.advantages[row, start + 3 : start + 10]
        assert prompt.tolist() == [0.0, 0.0, 0.0]
        assert completion.tolist() == torch.tensor([float(x) for x in expected], dtype=torch.float32).tolist()


def test_the_rl_loss_on_per_turn_advantages_matches_a_loop_over_tokens() -> None:
    cfg = AdvantageConfig(process_reward_weight=0.2, process_reward_credit="return")
    out = compute_advantages(GROUP, cfg, process_rewards=PROCESS)
    (batches,), _ = pack_step(out, seq_len=10, micro_batch_size=2, num_ranks=1, pad_token_id=0)
    (mb,) = batches
    gen = torch.Generator().manual_seed(3)
    inference = mb.inference_logprobs.double()
    logprobs = (
        inference + 0.3 * torch.randn(inference.shape, generator=gen, dtype=torch.float64)
    ).requires_grad_()
    loss_cfg = RLLossConfig(eps_low=0.2, eps_high=0.28, mask_ratio_low=None, mask_ratio_high=None)
    normalizer = rl_normalizer([mb.loss_mask], loss_cfg)
    loss, _ = rl_loss(logprobs, inference, mb.advantages.double(), mb.loss_mask, loss_cfg, normalizer)
    # The same loss, written as the PPO clip per token from the hand-derived advantages.
    total, count = 0.0, 0
    # The batch carries advantages as float32, so the hand values are rounded the same way.
    advantage_of = {i: torch.tensor([float(x) for x in a]).tolist() for i, a in enumerate(hand("return"))}
    for r in range(mb.input_ids.shape[0]):
        for t in range(mb.input_ids.shape[1]):
            if not mb.loss_mask[r, t]:
                continue
            sid = int(mb.sample_ids[r, t])
            first = int((mb.sample_ids[r] == sid).nonzero()[0])
            a = advantage_of[sid][t - first - 3]
            ratio = float(torch.exp(logprobs[r, t].detach() - inference[r, t]))
            total += -min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
            count += 1
    assert count == 10 and normalizer == 10
    assert loss.item() == pytest.approx(total / count, rel=1e-12)


def test_weight_zero_is_bitwise_the_loss_and_gradient_without_process_rewards() -> None:
    samples = [
        two_turn(r, (f"x{i}", f"y{i}"), group_id=i % 2, trace_id=str(i))
        for i, r in enumerate([1, 0, 0.3, 0.7])
    ]
    labels = [rewards(0.25, 1.0, -0.5), rewards(-1 / 3, -1 / 3, None), None, rewards(0.5, None, 0.5)]
    base = compute_advantages(samples, AdvantageConfig())
    results = []
    for credit in ("sequence", "step", "return", "potential"):
        cfg = AdvantageConfig(
            process_reward_weight=0.0, process_reward_credit=credit, process_reward_gamma=0.5
        )
        scored = compute_advantages(samples, cfg, process_rewards=labels)
        assert all(s.turn_advantages is None for s in scored)
        results.append(scored)
    loss_cfg = RLLossConfig()
    losses = []
    for scored in (base, *results):
        (batches,), _ = pack_step(scored, seq_len=20, micro_batch_size=2, num_ranks=1, pad_token_id=0)
        torch.manual_seed(0)
        logits = torch.randn(len(batches), 2, 20, 16, requires_grad=True)
        total = torch.zeros(())
        for k, mb in enumerate(batches):
            logp = torch.log_softmax(logits[k], -1).gather(-1, mb.input_ids[..., None])[..., 0]
            normalizer = rl_normalizer([b.loss_mask for b in batches], loss_cfg)
            total = (
                total
                + rl_loss(logp, mb.inference_logprobs, mb.advantages, mb.loss_mask, loss_cfg, normalizer)[0]
            )
        total.backward()
        assert logits.grad is not None
        losses.append((total.detach(), logits.grad.clone()))
    for loss, grad in losses[1:]:
        assert torch.equal(loss, losses[0][0]) and torch.equal(grad, losses[0][1])
    assert losses[0][0].item() != 0.0


def test_step_credit_keeps_a_group_whose_outcomes_are_equal() -> None:
    group = [two_turn(0.0, ("a", "b"), trace_id="A"), two_turn(0.0, ("c", "d"), trace_id="B")]
    cfg = AdvantageConfig(process_reward_weight=0.2, process_reward_credit="step")
    scored = compute_advantages(group, cfg, process_rewards=PROCESS)
    assert [s.advantage for s in scored] == [0.0, 0.0]
    kept, dropped = filter_zero_variance(scored)
    assert len(kept) == 2 and dropped == 0
    assert filter_zero_variance(compute_advantages(group, AdvantageConfig()))[1] == 1


def test_step_credit_needs_per_step_rewards() -> None:
    cfg = AdvantageConfig(process_reward_weight=0.2, process_reward_credit="step")
    with pytest.raises(ValueError, match=r"process_reward_credit = 'step' needs per-step process rewards"):
        compute_advantages(GROUP, cfg, process_rewards=[0.5, None])


def test_a_turn_span_outside_the_completion_is_refused() -> None:
    with pytest.raises(ValueError, match=r"turn advantage span \(5, 9\) is outside the completion \(0, 7\)"):
        two_turn(0.0, ("a", "b")).__class__(
            [1], [2] * 7, [0.0] * 7, [1] * 7, 0.0, 0, 0, 0, turn_advantages=[TurnAdvantage((5, 9), 1.0)]
        )


def test_lookup_gives_each_turn_the_votes_at_its_own_state(tmp_path: Path) -> None:
    path = tmp_path / "teacher.sqlite"
    store = TeacherStore(path)
    sample = two_turn(0.0, ("5", "6"), trace_id="ep")
    trace = parse_trace(episode_trace([sample]), "test", TraceSourceConfig())
    store.add_trace(trace)
    steps = trace.step_indices
    assert steps == [1, 3]
    # Label only the second turn's state: teachers vote 6, 6, 7 (the rollout said 6: 2/3 - 1/3).
    store.save_plan(trace.trace_id, [PlannedStep(3, trace.state_hash(3), {}, 1.0, 0.0, True)])
    votes = [
        {"teacher": f"t{i}", "outcome": "ok", "action": Action(message=v).key} for i, v in enumerate("667")
    ]
    store.finish_step(
        trace.trace_id, 3, status="done", outcome="confirmed", process_reward=1 / 3, trace_share=2 / 3,
        best_share=1 / 3, num_votes=3, votes=votes, cost_usd=0.0, pair=None,
    )  # fmt: skip
    teacher = TeacherClient(path)
    (found,) = ProcessRewards(teacher).lookup([sample])
    assert found is not None and found.mean == pytest.approx(1 / 3)
    assert [(s.index, s.span) for s in found.steps] == [(0, (0, 2)), (1, (4, 7))]
    assert found.steps[0].reward is None and found.steps[1].reward == pytest.approx(1 / 3)
    (scored,) = compute_advantages(
        [sample],
        AdvantageConfig(process_reward_weight=0.5, process_reward_credit="step"),
        process_rewards=[found],
    )
    # One rollout: outcome advantage 0, no other rollout for a baseline; turn 1 gets 0.5 * 1/3.
    assert scored.token_advantages() == pytest.approx([0.0, 0.0, 0.0, 0.0, 1 / 6, 1 / 6, 1 / 6])
    teacher.store.close()
    store.close()


def test_returns_run_across_the_samples_of_a_split_episode() -> None:
    def segment(trace_id: str, turn: int, reward: float) -> Sample:
        info = TurnInfo(index=turn, span=(0, 2), message_index=None, finish_reason="stop")
        record = EpisodeRecord(trace_id=trace_id, turns=[info], segment=turn, num_segments=2)
        return Sample([1], [5, 6], [-0.5, -0.5], [1, 1], reward, 0, 0, 0, episode=record)

    # Episode S (reward 1) is split in two Samples, one turn each; episode T (reward 0) unlabeled.
    samples = [segment("S", 0, 1.0), segment("S", 1, 1.0), segment("T", 0, 0.0)]
    labels = [
        ProcessReward(-0.25, (StepReward(0, (0, 2), 0.5),)),
        ProcessReward(-0.25, (StepReward(1, (0, 2), -1.0),)),
        None,
    ]
    cfg = AdvantageConfig(process_reward_weight=0.2, process_reward_credit="return")
    out = compute_advantages(samples, cfg, process_rewards=labels)
    # By hand: A_S = 1/2, A_T = -1/2 (episodes count once); b_S = 0 (T has no label);
    # turn 1: 1/2 + 0.2 * (-1) = 0.3; turn 0: 1/2 + 0.2 * (0.5 - 1) = 0.4.
    flat = [a for s in out for a in s.token_advantages()]
    assert flat == pytest.approx([0.4, 0.4, 0.3, 0.3, -0.5, -0.5], abs=1e-15)


# Potential-based credit (``process_reward_credit = "potential"``, Ng et al. 1999).


def test_potential_shaping_changes_the_return_only_by_the_start_potential() -> None:
    # Four turns, rewards only at the end, an arbitrary potential with Phi(s_0) != 0 and the
    # terminal Phi(s_4) = 0; gamma = 9/10. F by hand: F_k = gamma * Phi(s_k+1) - Phi(s_k).
    g = Fraction(9, 10)
    phi = [Fraction(3, 10), Fraction(1), Fraction(-1, 2), Fraction(1, 4), Fraction(0)]
    by_hand = [
        g * 1 - Fraction(3, 10),
        g * Fraction(-1, 2) - 1,
        g * Fraction(1, 4) + Fraction(1, 2),
        -Fraction(1, 4),
    ]
    assert potential_shaping(phi, g) == by_hand
    assert by_hand == [Fraction(3, 5), Fraction(-29, 20), Fraction(29, 40), Fraction(-1, 4)]
    rewards = [Fraction(0), Fraction(0), Fraction(0), Fraction(1)]
    unshaped = sum(g**k * r for k, r in enumerate(rewards))
    shaped = sum(g**k * (r + f) for k, (r, f) in enumerate(zip(rewards, by_hand, strict=True)))
    assert shaped - unshaped == -phi[0]  # exactly: gamma^T * Phi(s_T) = 0
    # The same in floats through the code's own function, as the trainer would see it.
    floats = potential_shaping([float(p) for p in phi], 0.9)
    assert sum(0.9**k * f for k, f in enumerate(floats)) == pytest.approx(-0.3, abs=1e-15)


def test_potential_credit_matches_the_hand_computation_and_telescopes() -> None:
    # GROUP: A's turns labeled 1 and -1/2, B's turn 0 labeled -1/3 and turn 1 not; w = 1/5, gamma = 1/2.
    # Phi(s_0) = 0, Phi(s_1) = p_0, Phi(s_2) = 0 (the episode has ended): the last turn's own label
    # never counts, and no leave-one-out baseline enters.
    w, g = Fraction(1, 5), Fraction(1, 2)
    f_a = [g * 1 - 0, g * 0 - 1]
    f_b = [g * Fraction(-1, 3) - 0, g * 0 - Fraction(-1, 3)]
    for f in (f_a, f_b):  # the episode's shaping sums to -Phi(s_0) = 0
        assert f[0] + g * f[1] == 0
    a = [Fraction(1, 2) + w * f for f in f_a]
    b = [Fraction(-1, 2) + w * f for f in f_b]
    z = Fraction(0)
    expected = [[a[0], a[0], z, z, a[1], a[1], a[1]], [b[0], b[0], z, z, b[1], b[1], b[1]]]
    cfg = AdvantageConfig(
        process_reward_weight=0.2, process_reward_credit="potential", process_reward_gamma=0.5
    )
    out = compute_advantages(GROUP, cfg, process_rewards=PROCESS)
    assert [s.advantage for s in out] == [0.5, -0.5]  # the outcome's advantage, unshaped
    for sample, hand_values in zip(out, expected, strict=True):
        assert sample.token_advantages() == pytest.approx([float(x) for x in hand_values], abs=1e-15)
    # Every turn of a labeled episode is credited, the unlabeled one too.
    assert [t.span for t in out[1].turn_advantages or []] == [(0, 2), (4, 7)]


def test_potential_credit_runs_across_the_samples_of_a_split_episode() -> None:
    def segment(trace_id: str, turn: int, reward: float) -> Sample:
        info = TurnInfo(index=turn, span=(0, 2), message_index=None, finish_reason="stop")
        record = EpisodeRecord(trace_id=trace_id, turns=[info], segment=turn, num_segments=3)
        return Sample([1], [5, 6], [-0.5, -0.5], [1, 1], reward, 0, 0, 0, episode=record)

    # Episode S (reward 1) in three Samples, turns 0 (label 0.5), 1 (none), 2 (label -1); T unlabeled.
    samples = [segment("S", 0, 1.0), segment("S", 2, 1.0), segment("S", 1, 1.0), segment("T", 0, 0.0)]
    labels = [
        ProcessReward(-0.25, (StepReward(0, (0, 2), 0.5),)),
        ProcessReward(-0.25, (StepReward(2, (0, 2), -1.0),)),
        ProcessReward(-0.25, (StepReward(1, (0, 2), None),)),
        None,
    ]
    cfg = AdvantageConfig(process_reward_weight=0.5, process_reward_credit="potential")
    out = compute_advantages(samples, cfg, process_rewards=labels)
    # By hand, gamma = 1: Phi = 0, 0.5, 0.5 (turn 1 unlabeled keeps the latest), 0 (ended).
    # F = 0.5, 0, -0.5; A_S = 1/2, A_T = -1/2; tokens: 1/2 + 0.5 * F.
    flat = [a for s in out for a in s.token_advantages()]
    assert flat == [0.75, 0.75, 0.25, 0.25, 0.5, 0.5, -0.5, -0.5]


def test_a_credit_rule_without_weight_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="prime_composer.config.advantage"):
        AdvantageConfig(process_reward_credit="potential")
    assert "process_reward_credit = 'potential' has no effect: process_reward_weight is 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prime_composer.config.advantage"):
        AdvantageConfig()
        AdvantageConfig(process_reward_weight=0.1, process_reward_credit="potential")
    assert caplog.text == ""

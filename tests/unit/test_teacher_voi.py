"""The calibrated gate: its prior is the heuristic, its SGD step is the log-loss gradient worked
out by hand, it learns a calibrated probability of disagreement from labels the heuristic ranks
badly, and the reliability table / ECE / Brier score match a hand computation."""

from __future__ import annotations

import math
import random

import pytest

from prime_composer.config.teacher import GateConfig
from prime_composer.teacher.gate import StepFeatures
from prime_composer.teacher.store import PlannedStep, TeacherStore
from prime_composer.teacher.voi import DisagreementModel, calibration, format_table, label_of


def test_with_no_label_the_model_is_the_heuristic_and_one_step_is_the_hand_gradient() -> None:
    cfg = GateConfig()
    f = StepFeatures(1, "s", uncertainty=0.4, impact=0.8, error=0.5, novelty=1.0)
    prior = f.score(cfg)
    model = DisagreementModel(learning_rate=0.5)
    assert model.predict(f.as_dict(), prior) == pytest.approx(prior, rel=1e-12)
    model.update(f.as_dict(), prior, 1)
    # d/dw of -log sigmoid(z) at z = logit(prior) is -(1 - prior) x, x = [1, u, e, impact, novelty].
    step = 0.5 * (1 - prior)
    assert model.weights == pytest.approx([step, step * 0.4, step * 0.5, step * 0.8, step * 1.0], rel=1e-12)
    z = math.log(prior / (1 - prior)) + step * (1 + 0.16 + 0.25 + 0.64 + 1.0)
    assert model.predict(f.as_dict(), prior) == pytest.approx(1 / (1 + math.exp(-z)), rel=1e-12)


def test_online_labels_calibrate_a_badly_calibrated_prior() -> None:
    """Truth: the teachers disagree with chance sigmoid(-3 + 5 u), whatever the error proximity;
    the heuristic prior (noisy-or with error proximity) overrates error-adjacent steps."""
    cfg = GateConfig()
    rng = random.Random(0)

    def draw() -> tuple[dict[str, float], float, float]:
        f = StepFeatures(1, "s", rng.random(), rng.choice([0.1, 0.8, 1.0]), rng.choice([0.0, 1.0]), 1.0)
        truth = 1 / (1 + math.exp(3 - 5 * f.uncertainty))
        return f.as_dict(), f.score(cfg), truth

    model = DisagreementModel(learning_rate=0.05)
    for _ in range(4000):
        features, prior, truth = draw()
        model.update(features, prior, int(rng.random() < truth))
    test = [draw() for _ in range(3000)]
    outcomes = [int(rng.random() < t) for _, _, t in test]
    before = calibration([p for _, p, _ in test], outcomes)
    after = calibration([model.predict(f, p) for f, p, _ in test], outcomes)
    assert after.ece < 0.05 < before.ece and after.brier < before.brier
    assert model.num_labels == 4000


def test_the_reliability_table_ece_and_brier_by_hand() -> None:
    report = calibration([0.05, 0.15, 0.15, 0.95], [0, 1, 0, 1])
    assert [(b[2], b[3], b[4]) for b in report.bins] == [(1, 0.05, 0.0), (2, 0.15, 0.5), (1, 0.95, 1.0)]
    assert report.ece == pytest.approx((0.05 + 2 * 0.35 + 0.05) / 4)
    assert report.brier == pytest.approx((0.0025 + 0.7225 + 0.0225 + 0.0025) / 4)
    assert format_table(report).splitlines()[-1].startswith("ECE 0.200  Brier 0.18")
    assert (label_of("pair"), label_of("pair_unmatched"), label_of("confirmed"), label_of("undecided")) == (
        1,
        1,
        0,
        None,
    )


def test_the_store_refits_the_model_and_reports_calibration(tmp_path) -> None:
    store = TeacherStore(tmp_path / "t.sqlite")
    from prime_composer.teacher.traces import TraceSourceConfig, parse_trace

    trace = {
        "id": "t",
        "turns": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "b"},
        ],
    }
    assert store.add_trace(parse_trace(trace, "test", TraceSourceConfig())) is None
    features = {"uncertainty": 0.5, "impact": 0.5, "error": 0.0, "novelty": 1.0}
    store.save_plan(
        "t",
        [
            PlannedStep(1, "s1", features | {"prior": 0.2}, 0.3, 0.01, True),
            PlannedStep(3, "s3", features | {"prior": 0.6}, 0.9, 0.01, True),
        ],
    )
    for turn, outcome in ((1, "confirmed"), (3, "pair")):
        store.finish_step(
            "t", turn, status="done", outcome=outcome, process_reward=0.0, trace_share=0.0,
            best_share=0.0, num_votes=2, votes=[], cost_usd=0.0, pair=None,
        )  # fmt: skip
    assert store.gate_examples() == [(features | {"prior": 0.2}, 0.2, 0), (features | {"prior": 0.6}, 0.6, 1)]
    gate = store.stats()["gate"]  # the stored scores 0.3 (agreed) and 0.9 (disagreed)
    assert gate["labels"] == 2
    assert gate["brier"] == pytest.approx((0.3**2 + 0.1**2) / 2)
    assert gate["ece"] == pytest.approx((0.3 + 0.1) / 2)
    refit = DisagreementModel(0.5).fit(store.gate_examples())
    by_hand = DisagreementModel(0.5)
    by_hand.update(features, 0.2, 0)
    by_hand.update(features, 0.6, 1)
    assert refit.weights == by_hand.weights


def test_calibrated_scores_rank_but_min_score_stays_the_heuristics() -> None:
    from prime_composer.teacher.gate import select_steps

    cfg = GateConfig(max_steps_per_trace=1, min_score=0.15)
    steps = [StepFeatures(i, f"s{i}", 0.9, 1.0, 1.0, 1.0) for i in (1, 3)] + [
        StepFeatures(5, "s5", 0.0, 0.0, 0.0, 0.0)  # heuristic score 0: never asked
    ]
    assert select_steps(steps, [1.0, 1.0, 1.0], cfg) == [1]  # equal heuristic scores: the first
    # Probabilities near the base rate (all below min_score) still pick one step, ranked by them.
    assert select_steps(steps, [1.0, 1.0, 1.0], cfg, scores=[0.05, 0.08, 0.99]) == [3]

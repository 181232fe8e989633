"""The ablation's statistics: Student-t quantiles, intervals over seeds and paired differences,
checked against printed tables and closed forms (no scipy on this machine)."""

from __future__ import annotations

import math
from statistics import mean

import pytest

from prime_composer.eval import ablate
from prime_composer.eval.tstats import betainc, paired_difference, t_cdf, t_interval, t_quantile

# Two-sided 95% (p = 0.975) and 99% (p = 0.995) critical values as printed in standard t tables
# (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2), three decimals.
T_TABLE_975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    9: 2.262,
    10: 2.228,
    20: 2.086,
    30: 2.042,
    100: 1.984,
}
T_TABLE_995 = {1: 63.657, 2: 9.925, 3: 5.841, 5: 4.032, 10: 3.169}


@pytest.mark.parametrize(("df", "expected"), sorted(T_TABLE_975.items()))
def test_t_quantile_matches_the_printed_table_at_95(df: int, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=6e-4)


@pytest.mark.parametrize(("df", "expected"), sorted(T_TABLE_995.items()))
def test_t_quantile_matches_the_printed_table_at_99(df: int, expected: float) -> None:
    assert t_quantile(0.995, df) == pytest.approx(expected, abs=6e-4)


def test_t_quantile_is_symmetric_and_approaches_the_normal() -> None:
    assert t_quantile(0.025, 3) == pytest.approx(-t_quantile(0.975, 3))
    assert t_quantile(0.5, 7) == pytest.approx(0.0, abs=1e-9)
    assert t_quantile(0.975, 100000) == pytest.approx(1.959964, abs=1e-4)


@pytest.mark.parametrize("t", [-7.0, -1.3, -0.2, 0.0, 0.4, 1.0, 2.5, 30.0])
def test_t_cdf_closed_forms(t: float) -> None:
    # df = 1 is the Cauchy distribution; df = 2 has the closed form 1/2 + t / (2 sqrt(2 + t^2)).
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


@pytest.mark.parametrize("x", [0.0, 0.05, 0.3, 0.5, 0.77, 0.999, 1.0])
def test_betainc_closed_forms(x: float) -> None:
    assert betainc(1.0, 1.0, x) == pytest.approx(x, abs=1e-12)
    assert betainc(3.0, 1.0, x) == pytest.approx(x**3, abs=1e-12)
    assert betainc(1.0, 2.0, x) == pytest.approx(1 - (1 - x) ** 2, abs=1e-12)
    with pytest.raises(ValueError, match="outside"):
        betainc(1.0, 1.0, 1.5)


def test_t_interval_by_hand() -> None:
    # [1, 2, 3]: mean 2, sample sd 1, half-width 4.303 / sqrt(3) = 2.4843.
    iv = t_interval([1.0, 2.0, 3.0])
    assert iv.n == 3
    assert iv.mean == pytest.approx(2.0)
    assert iv.ci_low == pytest.approx(2.0 - 4.3027 / math.sqrt(3), abs=1e-3)
    assert iv.ci_high == pytest.approx(2.0 + 4.3027 / math.sqrt(3), abs=1e-3)
    one = t_interval([0.4])
    assert (one.mean, one.ci_low, one.ci_high) == (0.4, None, None)
    assert t_interval([]).mean is None


def test_paired_difference_uses_only_common_seeds_and_removes_the_shared_spread() -> None:
    baseline = {0: 0.10, 1: 0.50, 2: 0.90, 3: 0.3}
    arm = {0: 0.15, 1: 0.56, 2: 0.94}  # seed 3 failed in this arm
    d = paired_difference(arm, baseline)
    diffs = [0.05, 0.06, 0.04]
    sd = math.sqrt(sum((x - 0.05) ** 2 for x in diffs) / 2)  # 0.01
    assert d.n == 3
    assert d.mean == pytest.approx(0.05)
    assert d.ci_low == pytest.approx(0.05 - 4.3027 * sd / math.sqrt(3), abs=1e-4)
    # The unpaired interval of the arm alone is far wider than the paired one.
    alone = t_interval(list(arm.values()))
    assert (alone.ci_high - alone.ci_low) > 20 * (d.ci_high - d.ci_low)


def _record(arm: str, seed: int, reward: float, start: float, end: float, usd: float = 0.0) -> dict:
    return {
        "arm": arm,
        "seed": seed,
        "status": "ok",
        "wall_s": 10.0,
        "final_reward": reward,
        "initial_eval": start,
        "final_eval": end,
        "teacher_usd": usd,
        "reward_curve": {"0": 0.0, "1": reward},
        "eval_curve": {"0": start, "1": end},
    }


def test_summarize_against_a_hand_computation(tmp_path) -> None:
    config = ablate.AblationConfig(
        path=tmp_path / "a.toml",
        base=[],
        output_dir=tmp_path,
        seeds=[0, 1, 2],
        baseline="grpo",
        set={},
        arms=[ablate.Arm("grpo"), ablate.Arm("replay")],
        rl_command=["rl"],
    )
    records = [
        _record("grpo", 0, 0.5, 0.3, 0.4),
        _record("grpo", 1, 0.6, 0.3, 0.5),
        _record("grpo", 2, 0.7, 0.4, 0.3),
        _record("replay", 0, 0.6, 0.3, 0.5, usd=0.1),
        {"arm": "replay", "seed": 1, "status": "failed", "returncode": 1, "log_tail": "boom", "wall_s": 3.0},
        _record("replay", 2, 0.9, 0.4, 0.6, usd=0.2),
    ]
    summary = ablate.summarize(config, records)
    grpo, replay = summary["arms"]["grpo"], summary["arms"]["replay"]
    assert grpo["final_eval"]["mean"] == pytest.approx(0.4)
    half = 4.3027 * 0.1 / math.sqrt(3)  # sd of [0.4, 0.5, 0.3] is 0.1
    assert grpo["final_eval"]["ci_low"] == pytest.approx(0.4 - half, abs=1e-4)
    assert grpo["eval_gain"]["mean"] == pytest.approx(mean([0.1, 0.2, -0.1]))
    assert replay["seeds_ok"] == [0, 2] and replay["seeds_failed"] == [1]
    assert replay["teacher_usd"] == pytest.approx(0.3)
    assert replay["wall_s"] == pytest.approx(20.0)  # the failed run is not counted as a finished arm's time
    # Paired over seeds 0 and 2: reward differences 0.1 and 0.2; held-out 0.1 and 0.3.
    vs = replay["vs_baseline"]
    assert vs["final_reward"]["n"] == 2
    assert vs["final_reward"]["mean"] == pytest.approx(0.15)
    sd = math.sqrt(2 * 0.05**2)  # sample sd of [0.1, 0.2]
    assert vs["final_reward"]["ci_high"] == pytest.approx(0.15 + 12.7062 * sd / math.sqrt(2), abs=1e-3)
    assert vs["final_eval"]["mean"] == pytest.approx(0.2)
    assert "vs_baseline" not in grpo
    text = ablate.render_markdown(config, summary, records)
    assert "| replay | 2/3 |" in text
    assert "replay seed 1**: exit status 1" in text and "boom" in text

"""The gate's calibrated model of value of information: the chance that the teachers disagree with
the trace at a step, learned online from the labels the service buys, and its calibration.

``gate.model = "calibrated"``: a logistic regression whose offset is the heuristic's score (the
prior, ``gate.py``'s noisy-or x stakes x novelty, clipped to [1e-3, 1 - 1e-3])::

    p(disagree | step) = sigmoid(logit(prior) + w . [1, uncertainty, error, impact, novelty])

With ``w = 0`` (no label yet) ``p`` is the prior. Every labeled step is one example: ``1`` when it
became a pair (a teacher majority wants another action), ``0`` when the teachers confirmed the
trace's action; undecided, unvoted, refused or skipped steps teach nothing. One step of SGD on the
log loss per example (``w <- w - lr (p - y) x``), as the labels come; a restarted service refits
from the store (in the order the steps were planned). A pair is worth one unit, so a step's expected value is ``p`` and the
gate ranks by ``p`` per expected dollar.

``calibration`` measures either predictor (the heuristic's score taken as a probability, or the
model's ``p``) on the labeled steps, each scored by what was predicted when its trace was planned:
a reliability table (10 bins of the prediction: count, mean prediction, observed rate), the
expected calibration error (bins weighted by count) and the Brier score.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

FEATURES = ("uncertainty", "error", "impact", "novelty")
POSITIVE = frozenset({"pair", "pair_unmatched"})
"""Step outcomes where the teachers disagreed with the trace."""
NEGATIVE = frozenset({"confirmed"})


def _logit(p: float) -> float:
    p = min(1.0 - 1e-3, max(1e-3, p))
    return math.log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def label_of(outcome: str | None) -> int | None:
    """1 (disagreed), 0 (confirmed) or None (no label) for a step's outcome."""
    if outcome in POSITIVE:
        return 1
    if outcome in NEGATIVE:
        return 0
    return None


class DisagreementModel:
    """``p(teachers disagree | features)`` with the heuristic score as prior (module docstring)."""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = learning_rate
        self.weights = [0.0] * (1 + len(FEATURES))
        self.num_labels = 0

    @staticmethod
    def _x(features: Mapping[str, float]) -> list[float]:
        return [1.0, *(float(features.get(name, 0.0)) for name in FEATURES)]

    def predict(self, features: Mapping[str, float], prior: float) -> float:
        x = self._x(features)
        return _sigmoid(_logit(prior) + sum(w * v for w, v in zip(self.weights, x, strict=True)))

    def update(self, features: Mapping[str, float], prior: float, disagreed: int) -> None:
        gap = self.predict(features, prior) - disagreed
        x = self._x(features)
        self.weights = [w - self.learning_rate * gap * v for w, v in zip(self.weights, x, strict=True)]
        self.num_labels += 1

    def fit(self, examples: Iterable[tuple[Mapping[str, float], float, int]]) -> DisagreementModel:
        for features, prior, disagreed in examples:
            self.update(features, prior, disagreed)
        return self


@dataclass(frozen=True)
class Calibration:
    bins: list[tuple[float, float, int, float, float]]
    """``(low, high, count, mean prediction, observed rate)`` of each non-empty bin."""
    ece: float
    brier: float
    count: int


def calibration(predicted: Sequence[float], observed: Sequence[int], num_bins: int = 10) -> Calibration:
    """The reliability table, expected calibration error and Brier score of ``predicted``
    probabilities against ``observed`` 0/1 outcomes (the last bin includes 1.0)."""
    if len(predicted) != len(observed):
        raise ValueError(f"{len(predicted)} predictions for {len(observed)} outcomes")
    n = len(predicted)
    if n == 0:
        return Calibration([], 0.0, 0.0, 0)
    members: list[list[int]] = [[] for _ in range(num_bins)]
    for i, p in enumerate(predicted):
        members[min(num_bins - 1, int(p * num_bins))].append(i)
    bins, ece = [], 0.0
    for b, idx in enumerate(members):
        if not idx:
            continue
        mean_p = sum(predicted[i] for i in idx) / len(idx)
        rate = sum(observed[i] for i in idx) / len(idx)
        bins.append((b / num_bins, (b + 1) / num_bins, len(idx), mean_p, rate))
        ece += len(idx) / n * abs(mean_p - rate)
    brier = sum((p - y) ** 2 for p, y in zip(predicted, observed, strict=True)) / n
    return Calibration(bins, ece, brier, n)


def format_table(report: Calibration) -> str:
    """The reliability table as text (one line per bin, then ECE and Brier)."""
    lines = ["bin          n  predicted  observed"]
    for low, high, count, mean_p, rate in report.bins:
        lines.append(f"[{low:.1f}, {high:.1f})  {count:4d}  {mean_p:9.3f}  {rate:8.3f}")
    lines.append(f"ECE {report.ece:.3f}  Brier {report.brier:.3f}  over {report.count} labeled steps")
    return "\n".join(lines)

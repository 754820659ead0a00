"""The statistics of a privacy audit in one training run (Steinke, Nasr and Jagielski, "Privacy
Auditing with One (1) Training Run", NeurIPS 2023): from the auditor's guesses to the empirical
lower bound on epsilon.

m canaries are each included with probability 1/2, independently; after the run the auditor
guesses "in" for the k+ canaries of highest score, "out" for the k- of lowest, and abstains on the
rest. If the run is (epsilon, delta)-DP, the number W of correct guesses among the r = k+ + k- is
dominated by Binomial(r, e^eps / (1 + e^eps)), with a correction for delta (their Theorem 3 and
Proposition 5): for every v,

    P[W >= v] <= P[Binomial(r, q) >= v] + 2 m delta max_{1<=i<=v} P[v > Binomial(r, q) >= v - i] / i,

q = e^eps / (1 + e^eps). The lower bound at confidence 1 - p is the largest epsilon at which the
observed W is still rejected (that bound below p): the run is not (epsilon, delta)-DP for any
smaller epsilon, with probability at least 1 - p over the canaries' inclusion.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
"""The confidence of the reported lower bound."""
_BISECTIONS = 60
"""Halvings of the bracket around the bound: far below the bound's own resolution."""


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"the audit's counts must satisfy 0 <= correct <= guesses <= canaries, got correct "
                         f"{correct}, guesses {guesses}, canaries {canaries}")


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The largest probability an (epsilon, delta)-DP run gives to `correct` or more correct
    guesses among `guesses` on `canaries` canaries (the module docstring's bound, capped at 1)."""
    _check_counts(canaries, guesses, correct)
    if not (epsilon >= 0 and 0 <= delta <= 1):
        raise ValueError(f"the audit needs epsilon >= 0 and delta in [0, 1], got epsilon {epsilon}, delta {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(correct - 1, guesses, q))
    if correct == 0 or delta == 0:
        return min(1.0, tail)
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)  # P[W = v - i] for i = 1 .. v
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, tail + 2 * canaries * delta * alpha)


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float,
                        confidence: float = CONFIDENCE) -> float:
    """The empirical lower bound on epsilon at `confidence`: the largest epsilon whose p_value
    of the observed guesses is below 1 - confidence (0 when even epsilon 0 is not rejected)."""
    if not 0 < confidence < 1:
        raise ValueError(f"the audit's confidence must be in (0, 1), got {confidence}")
    level = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < level:
        low, high = high, 2 * high
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if p_value(canaries, guesses, correct, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


def score_guesses(scores: np.ndarray, included: np.ndarray, guess_in: int, guess_out: int) -> tuple[int, int]:
    """(guesses, correct): "in" for the `guess_in` canaries of highest score, "out" for the
    `guess_out` of lowest, against whether each was `included`. Ties are broken by canary index
    (a stable sort), so the same scores always give the same guesses."""
    if guess_in < 0 or guess_out < 0 or guess_in + guess_out > len(scores):
        raise ValueError(f"guess_in {guess_in} and guess_out {guess_out} must be non-negative and together at "
                         f"most the {len(scores)} canaries")
    order = np.argsort(scores, kind="stable")
    guessed_in = order[len(order) - guess_in:] if guess_in else order[:0]
    guessed_out = order[:guess_out]
    correct = int(np.sum(included[guessed_in])) + int(np.sum(~included[guessed_out]))
    return guess_in + guess_out, correct

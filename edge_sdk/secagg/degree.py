"""The masking graph's degree a round needs to survive losing a given fraction of its devices.

A device's two secrets are shared t-of-k among its k neighbours, so a round fails when some device
keeps fewer than t of them: loses more than k - t. With `lost` of the n participants lost after
key sharing, uniformly at random, the lost among one device's k neighbours (k of the other n - 1)
are hypergeometric; a union bound over the n devices bounds the chance that any of them fails.
Exact, in integers (math.comb): no scipy on edge devices, and n is at most a few thousand.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

from .errors import SecAggError

FAILURE = 1e-6
"""The chance of a failed round that a derived degree accepts."""


def threshold_of(degree: int, fraction: float) -> int:
    """t for `degree` neighbours: floor(fraction x degree) + 1 (above degree/2), at most degree."""
    return min(degree, math.floor(fraction * degree) + 1)


def lost_of(count: int, dropout: float) -> int:
    """floor(dropout x count), with dropout read as written (0.29 x 100 is 29, not 28.999...)."""
    return math.floor(Fraction(str(dropout)) * count)


def failure_bound(count: int, degree: int, lost: int, fraction: float) -> Fraction:
    """Union bound (at most 1) on the chance that, with `lost` of `count` devices lost at random,
    some device's `degree` neighbours lose more than degree - t. Counts `lost` among each device's
    candidates (the other count - 1), the conservative case of a device that is not lost itself."""
    others = count - 1
    if not 1 <= degree <= others or not 0 <= lost <= others:
        raise SecAggError(f"need 1 <= degree <= {others} and 0 <= lost <= {others}, got {degree} and {lost}")
    tolerated = degree - threshold_of(degree, fraction)
    lowest, highest = max(0, degree - (others - lost)), min(degree, lost)
    if tolerated >= highest:
        return Fraction(0)
    total = math.comb(others, degree)

    def ways(low: int, high: int) -> int:
        return sum(_ways(others, lost, degree, x) for x in range(low, high + 1))

    # the shorter of the two sums: the tail itself, or everything minus the rest
    above = ways(tolerated + 1, highest) if highest - tolerated <= tolerated - lowest + 1 \
        else total - ways(lowest, tolerated)
    return min(Fraction(1), Fraction(count * above, total))


def _ways(others: int, lost: int, degree: int, hit: int) -> int:
    """How many `degree`-subsets of `others` devices hold exactly `hit` of the `lost`."""
    return math.comb(lost, hit) * math.comb(others - lost, degree - hit)


def _meets(count: int, degree: int, lost: int, fraction: float, limit: Fraction) -> bool:
    """Whether `failure_bound` is at most `limit`; refused first on the tail's largest term alone
    (a lower bound on the tail, three combs instead of a sum), which settles most degrees."""
    others, tolerated = count - 1, degree - threshold_of(degree, fraction)
    if tolerated >= min(degree, lost):
        return True
    peak = min(degree, lost, max(tolerated + 1, (degree + 1) * (lost + 1) // (others + 2)))
    if count * _ways(others, lost, degree, peak) > limit * math.comb(others, degree):
        return False
    return failure_bound(count, degree, lost, fraction) <= limit


@lru_cache(maxsize=256)
def degree_for(count: int, dropout: float, fraction: float, failure: float = FAILURE) -> int:
    """The smallest even degree (or count - 1, the complete graph) whose `failure_bound` with
    `lost_of(count, dropout)` lost is at most `failure`; count - 1 when none is."""
    if count < 2:
        raise SecAggError(f"need at least 2 devices for a graph, got {count}")
    if not 0 <= dropout < 1 or not 0 < failure < 1:
        raise SecAggError(f"need dropout in [0, 1) and failure in (0, 1), got {dropout} and {failure}")
    lost, limit = lost_of(count, dropout), Fraction(failure)
    complete = count - 1
    candidates = [*range(2, complete + 1, 2), *([complete] if complete % 2 else [])]
    return next((degree for degree in candidates if _meets(count, degree, lost, fraction, limit)), complete)

"""The masking graph's degree derived from --secagg-dropout: minimal, checked against an independent
count of the tail and against random loss patterns over the actual ring graph; refused out of range."""

from __future__ import annotations

import itertools
import logging
import math
from fractions import Fraction

import numpy as np
import pytest

from coordinator.config.run_config import build_config
from coordinator.rounds.secagg import SecureRound
from edge_sdk.config import ConfigError
from edge_sdk.privacy.secagg_settings import SecAggSettings
from edge_sdk.secagg import stages
from edge_sdk.secagg.context import RoundContext
from edge_sdk.secagg.degree import FAILURE, degree_for, failure_bound, lost_of
from edge_sdk.secagg.graph import neighbours

THRESHOLD = 0.6
DERIVED = {(50, 0.1): 14, (50, 0.3): 38, (200, 0.1): 36, (200, 0.3): 146}
"""As computed at the default threshold 0.6 (the docs quote them); the tests below assert why."""


def _subsets_by_lost(others: int, lost: int) -> list[list[int]]:
    """counts[k][x]: k-subsets of `others` candidates holding x of the `lost` ones, built one
    candidate at a time (no binomial formula), so it checks `failure_bound` independently."""
    counts = np.zeros((others + 1, lost + 1), dtype=object)
    counts[0, 0] = 1
    for candidate in range(others):
        taken = np.zeros_like(counts)
        if candidate < lost:
            taken[1:, 1:] = counts[:-1, :-1]
        else:
            taken[1:, :] = counts[:-1, :]
        counts = counts + taken
    return counts.tolist()


def _independent_bound(counts: list[list[int]], count: int, degree: int) -> Fraction:
    row = counts[degree]
    tolerated = degree - (math.floor(THRESHOLD * degree) + 1)
    return min(Fraction(1), Fraction(count * sum(row[tolerated + 1:]), sum(row)))


def _candidates_below(count: int, degree: int) -> list[int]:
    return [k for k in sorted({*range(2, count, 2), count - 1}) if k < degree]


@pytest.mark.parametrize(("count", "dropout"), [(12, 0.25), (16, 0.2), (50, 0.1), (50, 0.3), (200, 0.1),
                                                (200, 0.3)])
def test_the_derived_degree_is_the_smallest_that_meets_the_bound(count, dropout):
    # Arrange
    lost = lost_of(count, dropout)
    counts = _subsets_by_lost(count - 1, lost)

    # Execute
    degree = degree_for(count, dropout, THRESHOLD)

    # Assert: it meets the bound, every smaller candidate (k - 2 among them) does not, and the
    # exact tail agrees with the independent count wherever it was consulted
    assert degree % 2 == 0 and 2 <= degree <= count - 1
    assert _independent_bound(counts, count, degree) <= FAILURE
    below = _candidates_below(count, degree)
    assert degree - 2 in below or degree == 2
    assert all(_independent_bound(counts, count, k) > FAILURE for k in below)
    for k in [*below, degree]:
        assert failure_bound(count, k, lost, THRESHOLD) == _independent_bound(counts, count, k)
    if (count, dropout) in DERIVED:
        assert degree == DERIVED[(count, dropout)]


def test_the_tail_matches_brute_force_enumeration_of_neighbourhoods():
    # Arrange: 11 candidate neighbours, 3 of them lost
    count, lost = 12, 3
    for degree in range(1, count):
        tolerated = degree - (math.floor(THRESHOLD * degree) + 1)
        subsets = list(itertools.combinations(range(count - 1), degree))
        too_many = sum(1 for subset in subsets if sum(1 for device in subset if device < lost) > tolerated)

        # Execute / Assert
        assert failure_bound(count, degree, lost, THRESHOLD) == min(1, Fraction(count * too_many, len(subsets)))


def test_no_dropout_keeps_the_configured_degree_and_a_dropout_raises_it():
    assert SecAggSettings().degree_for(50) == 16
    assert SecAggSettings(secagg_degree=15).degree_for(50) == 16  # rounded up to even, as the graph does
    assert SecAggSettings().degree_for(10) == 9  # all the others when fewer take part
    assert SecAggSettings(secagg_degree=4, secagg_dropout=0.3).degree_for(50) == DERIVED[(50, 0.3)]
    assert SecAggSettings(secagg_degree=48, secagg_dropout=0.1).degree_for(50) == 48  # the least degree stays
    assert SecAggSettings(secagg_dropout=0.1).degree_for(9) == 8  # nobody lost at 9 devices: 16, as many as there are


def test_with_no_device_lost_the_smallest_graph_is_enough():
    assert lost_of(9, 0.1) == 0 and degree_for(9, 0.1, THRESHOLD) == 2


def test_the_lost_count_reads_the_fraction_as_written():
    assert 0.29 * 100 < 29 and lost_of(100, 0.29) == 29


def _losses_beyond_tolerance(count: int, degree: int, lost: int, patterns: int) -> np.ndarray:
    """Per random loss pattern, the most any device's neighbourhood lost beyond k - t, over the ring graph."""
    ids = [f"dev{i:03d}" for i in range(count)]
    graph = neighbours(ids, degree, b"a fixed public seed")
    adjacent = np.array([[peer in graph[node] for peer in ids] for node in ids], dtype=np.int32)
    assert (adjacent.sum(axis=1) == degree).all()
    rng = np.random.default_rng(7)
    gone = np.zeros((patterns, count), dtype=np.int32)
    np.put_along_axis(gone, rng.random((patterns, count)).argsort(axis=1)[:, :lost], 1, axis=1)
    tolerated = degree - (math.floor(THRESHOLD * degree) + 1)
    return (gone @ adjacent.T).max(axis=1) - tolerated


@pytest.mark.parametrize(("count", "dropout"), [(50, 0.3), (200, 0.3)])
def test_random_losses_never_fail_a_round_at_the_derived_degree_and_do_at_the_default(count, dropout):
    # Arrange
    lost = lost_of(count, dropout)

    # Execute
    derived = _losses_beyond_tolerance(count, degree_for(count, dropout, THRESHOLD), lost, 2000)
    default = _losses_beyond_tolerance(count, 16, lost, 2000)

    # Assert
    assert (derived <= 0).all()
    assert (default > 0).sum() > 100


def test_when_even_the_complete_graph_falls_short_it_is_used_and_the_shortfall_logged(caplog):
    # Arrange: 9 of 20 lost; the complete graph (19, t = 12) survives 7
    settings = SecAggSettings(secagg_dropout=0.45)

    # Execute
    with caplog.at_level(logging.WARNING):
        degree = settings.degree_for(20)

    # Assert
    assert degree == 19
    assert "survive 9 lost" in caplog.text and "survives only 7: 2 short" in caplog.text


def test_a_round_announces_the_derived_degree_and_its_threshold():
    # Arrange
    settings = SecAggSettings(secure_aggregation=True, secagg_dropout=0.3)
    devices = [f"dev{i:02d}" for i in range(50)]

    # Execute
    secure = SecureRound(settings, "run", 1, devices, {"shared": {"w": ((3,), "float32")}},
                         {device: 10 for device in devices})

    # Assert: a device builds the same context from what the advertise stage carries, which names no
    # graph seed; any seed the advertisements fix gives every device 38 neighbours
    announced = secure.config(stages.ADVERTISE)
    assert (announced[stages.DEGREE], announced[stages.THRESHOLD]) == (38, 23)
    assert stages.GRAPH_SEED not in announced
    device_side = RoundContext("run", 1, tuple(announced[stages.PARTICIPANTS]), announced[stages.THRESHOLD],
                               announced[stages.DEGREE], None, announced[stages.LENGTH])
    assert device_side == secure.context
    assert all(len(peers) == 38 for peers in device_side.with_graph_seed(bytes(32)).graph.values())


@pytest.mark.parametrize("dropout", [-0.1, 0.5, 0.9, float("nan")])
def test_a_dropout_outside_0_to_a_half_is_refused_naming_the_key(dropout):
    with pytest.raises(ConfigError, match=r"^secagg_dropout must be in \[0, 0\.5\)"):
        build_config(None, {"secagg_dropout": dropout}, {})

"""Unit tests for edge_sdk/secagg/bounds.py: the colluders and losses a round withstands, checked
against every placement on the ring graph the rounds mask over (graph.py), and the report's
`secagg` entry and summary line built from them."""

from __future__ import annotations

from itertools import combinations

import pytest

from coordinator.run.report_files import secagg_bounds_line, secagg_report
from edge_sdk.privacy.secagg_settings import SecAggSettings
from edge_sdk.secagg.bounds import tolerance
from edge_sdk.secagg.degree import threshold_of
from edge_sdk.secagg.graph import neighbours


def ring(devices: int, degree: int) -> dict[str, frozenset[str]]:
    return neighbours([f"d{i:02d}" for i in range(devices)], degree, b"seed")


def exposed(graph: dict[str, frozenset[str]], colluders: set[str], threshold: int) -> bool:
    """Whether some honest device's two secrets can both be rebuilt: t shares of each, the
    colluders giving both and each honest neighbour one (told a different story each)."""
    degree = len(next(iter(graph.values())))
    return any(2 * threshold <= degree + len(near & colluders) for node, near in graph.items() if node not in colluders)


def stuck(graph: dict[str, frozenset[str]], lost: set[str], threshold: int) -> bool:
    """Whether some device keeps fewer than t answering neighbours: a secret cannot be rebuilt."""
    return any(len(near - lost) < threshold for near in graph.values())


@pytest.mark.parametrize(("devices", "degree", "fraction"), [(9, 4, 0.5), (9, 6, 0.6), (10, 8, 0.7), (7, 6, 0.5)])
def test_the_worst_case_figures_are_exact_over_every_placement_on_the_ring(devices, degree, fraction):
    # Prepare
    graph = ring(devices, degree)
    threshold = threshold_of(degree, fraction)
    ids = sorted(graph)

    # Execute
    bounds = tolerance(devices, degree, threshold, fraction)

    # Assert: no placement of C colluders exposes a device, some placement of C + 1 does; the
    # same for the lost devices and the sum
    assert bounds.colluders == max(0, 2 * threshold - degree - 1)
    assert not any(exposed(graph, set(c), threshold) for c in combinations(ids, bounds.colluders))
    assert any(exposed(graph, set(c), threshold) for c in combinations(ids, bounds.colluders + 1))
    assert not any(stuck(graph, set(d), threshold) for d in combinations(ids, bounds.lost))
    assert any(stuck(graph, set(d), threshold) for d in combinations(ids, bounds.lost + 1))
    assert bounds.colluders_protocol_followed == threshold - 1
    assert bounds.lost_at_random >= bounds.lost


def test_the_default_settings_withstand_three_colluders_and_six_lost_at_fifty_devices():
    settings = SecAggSettings()
    degree = settings.degree_for(50)

    bounds = tolerance(50, degree, settings.threshold_for(degree), settings.secagg_threshold)

    # k 16, t floor(0.6 x 16) + 1 = 10: 2t - k - 1 = 3 colluders, t - 1 = 9, k - t = 6 lost
    assert (bounds.degree, bounds.threshold) == (16, 10)
    assert (bounds.colluders, bounds.colluders_protocol_followed, bounds.lost) == (3, 9, 6)


def test_the_report_gives_the_figures_per_round_size_and_the_summary_the_weakest():
    # Prepare: two rounds of 50 devices masked, one of 4, one too small to be played
    rounds = [{"round": r, "secagg": {"selected": n}} for r, n in ((1, 50), (2, 4), (3, 50), (4, 2))]

    # Execute
    report = secagg_report(SecAggSettings(), rounds, sharded=False)
    line = secagg_bounds_line(report)

    # Assert
    assert [(f["devices"], f["degree"], f["threshold"], f["rounds"]) for f in report["by_devices"]] == [
        (4, 3, 2, [2]), (50, 16, 10, [1, 3])]
    assert line is not None and line.startswith("n 4, k 3, t 2:") and "up to 0 colluding devices" in line


def test_a_sharded_run_gives_the_figures_of_each_shard_s_size():
    # Prepare: two rounds of 60 devices in two shards, one of 40 and 20, one of 30 and 30
    rounds = [{"round": 1, "secagg": {"selected": 60, "groups": [20, 40]}},
              {"round": 2, "secagg": {"selected": 60, "groups": [30, 30]}}]

    # Execute
    report = secagg_report(SecAggSettings(), rounds, sharded=True)

    # Assert: per shard size, not per round's 60
    assert report["sharded"] is True
    assert [(f["devices"], f["rounds"]) for f in report["by_devices"]] == [(20, [1]), (30, [2]), (40, [1])]


def test_a_round_the_graph_cannot_hold_is_refused_by_name():
    with pytest.raises(ValueError, match="threshold <= degree < devices"):
        tolerance(4, 4, 3, 0.6)

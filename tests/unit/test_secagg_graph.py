"""SecAgg+'s public neighbour graph: symmetric, the right degree, the same for everyone."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.secagg import SecAggError, effective_degree, neighbours

IDS = [f"dev{i:02d}" for i in range(12)]


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 12), degree=st.integers(1, 14), seed=st.binary(min_size=1, max_size=32))
def test_the_graph_is_symmetric_without_self_loops_and_of_the_stated_degree(count, degree, seed):
    # Execute
    graph = neighbours(IDS[:count], degree, seed)

    # Assert
    assert set(graph) == set(IDS[:count])
    for node, adjacent in graph.items():
        assert node not in adjacent
        assert all(node in graph[peer] for peer in adjacent)
        assert len(adjacent) == (effective_degree(count, degree) if count > 1 else 0)


def test_odd_degrees_round_up_to_even():
    assert effective_degree(12, 3) == 4 and effective_degree(12, 4) == 4 and effective_degree(5, 3) == 4


@pytest.mark.parametrize("degree", [11, 12, 40])
def test_a_degree_of_n_minus_1_or_more_gives_the_complete_graph(degree):
    graph = neighbours(IDS, degree, b"seed")
    assert all(adjacent == set(IDS) - {node} for node, adjacent in graph.items())


def test_everyone_computes_the_same_graph_from_the_same_seed():
    # Prepare
    seed = secrets.token_bytes(32)

    # Execute
    graphs = [neighbours(IDS, 4, seed), neighbours(list(reversed(IDS)), 4, seed)]

    # Assert
    assert graphs[0] == graphs[1]


def test_another_seed_gives_another_graph():
    # 11!/2 rings of 12 nodes: two seeds giving one graph would be a bug, not luck
    assert neighbours(IDS, 4, b"one") != neighbours(IDS, 4, b"two")


def test_bad_input_is_rejected():
    with pytest.raises(SecAggError, match="distinct"):
        neighbours(["a", "a"], 2, b"s")
    with pytest.raises(SecAggError, match="degree"):
        neighbours(["a", "b"], 0, b"s")
    with pytest.raises(SecAggError, match="seed"):
        neighbours(["a", "b"], 1, b"")

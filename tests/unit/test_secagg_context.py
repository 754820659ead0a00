"""The round context: validated parameters and a canonical encoding that binds every field."""

from __future__ import annotations

import dataclasses

import pytest

from edge_sdk.secagg import RoundContext, SecAggError

PEERS = tuple(f"dev{i}" for i in range(10))
BASE = RoundContext("run", 3, PEERS, threshold=3, degree=4, graph_seed=bytes(32), vector_length=100)


@pytest.mark.parametrize("change", [
    {"run_id": "run2"}, {"round": 4}, {"participants": PEERS[:9]}, {"threshold": 4}, {"degree": 3},
    {"graph_seed": b"\x01" * 32}, {"vector_length": 101},
])
def test_every_field_changes_the_canonical_bytes(change):
    assert dataclasses.replace(BASE, **change).bytes() != BASE.bytes()


@pytest.mark.parametrize(("change", "field"), [
    ({"threshold": 2}, "threshold"),   # not more than half the degree
    ({"threshold": 5}, "threshold"),   # more than the degree
    ({"participants": ("b", "a")}, "sorted"),
    ({"participants": ("a",)}, "at least 2"),
    ({"participants": ("a", "")}, "participants"),
    ({"graph_seed": b"short"}, "graph_seed"),
    ({"vector_length": 0}, "vector_length"),
    ({"round": -1}, "round"),
    ({"degree": 0}, "degree"),
    ({"run_id": ""}, "run_id"),
])
def test_invalid_parameters_are_rejected(change, field):
    with pytest.raises(SecAggError, match=field):
        dataclasses.replace(BASE, **change)


def test_share_coordinates_are_one_based_indices_and_graph_is_the_contexts():
    assert BASE.share_x("dev0") == 1 and BASE.share_x("dev9") == 10
    assert all(len(BASE.neighbours_of(peer)) == 4 for peer in PEERS)
    with pytest.raises(SecAggError, match="'ghost' is not a participant"):
        BASE.neighbours_of("ghost")

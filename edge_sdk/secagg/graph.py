"""SecAgg+'s sparse neighbour graph: who shares keys and masks with whom in a round.

Bonawitz et al. connect every pair of devices (n^2 key agreements and masks); Bell et al. show a
random graph of logarithmic degree keeps the same guarantees. Here the graph is a Harary-style
ring: the ids are shuffled by a public seed (each sorted by HMAC-SHA256(seed, id)), placed on a
ring, and each is joined to the degree/2 nearest ids on either side. Every party computes the same
graph from the same seed, so it never has to be sent; the seed is a hash of the round's
advertisements (consistency.graph_seed), fixed only after every participant drew its keys, so
nobody chooses a device's place on the ring.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from .errors import SecAggError


def effective_degree(count: int, degree: int) -> int:
    """The degree each of `count` devices gets: `degree` rounded up to even, at most count - 1."""
    if degree < 1:
        raise SecAggError(f"degree must be at least 1, got {degree}")
    return min(degree + degree % 2, count - 1)


def neighbours(ids: Sequence[str], degree: int, seed: bytes) -> dict[str, frozenset[str]]:
    """Each id's neighbours: symmetric, no self-loops, every id with `effective_degree` neighbours."""
    ordered = sorted(ids)
    if len(set(ordered)) != len(ordered):
        raise SecAggError("ids must be distinct")
    if not seed:
        raise SecAggError("seed must be non-empty bytes")
    count = len(ordered)
    if count == 0:
        return {}
    reach = effective_degree(count, degree)
    if reach >= count - 1:
        return {node: frozenset(ordered) - {node} for node in ordered}
    ring = sorted(ordered, key=lambda node: hmac.new(seed, node.encode(), hashlib.sha256).digest())
    half = reach // 2
    return {node: frozenset(ring[(place + step) % count] for step in range(-half, half + 1) if step)
            for place, node in enumerate(ring)}

"""The public parameters of one secure-aggregation round, and their canonical byte encoding.

Every party (each device and the server) builds the same `RoundContext` from the round's
announcement, without a graph seed: nobody may choose it. Once the advertisements are fixed, each
party derives the seed from all of them (consistency.graph_seed) and takes `with_graph_seed`. Its
`bytes()` are bound into every share, key derivation, AEAD tag and survivor signature of the
round, and its `announced_bytes()` (every field but the seed) into the advertisements, so a
message from another run, round, participant set or graph never verifies.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TypeGuard

from .errors import SecAggError
from .graph import effective_degree, neighbours

DOMAIN = b"edgepfl-secagg-v1"
GRAPH_SEED_BYTES = 32
MAX_ID_BYTES = 256


def canonical(*parts: bytes) -> bytes:
    """Concatenate `parts`, each prefixed with its 4-byte big-endian length: an unambiguous encoding."""
    return b"".join(struct.pack(">I", len(part)) + part for part in parts)


def is_device_id(value: object) -> TypeGuard[str]:
    """Whether `value` can name a device: a non-empty string of at most 256 UTF-8 bytes."""
    if not isinstance(value, str):
        return False
    try:
        return 0 < len(value.encode()) <= MAX_ID_BYTES
    except UnicodeEncodeError:
        return False


def _check_ids(participants: tuple[str, ...]) -> None:
    if not isinstance(participants, tuple) or not all(is_device_id(p) for p in participants):
        raise SecAggError(f"participants must be a tuple of non-empty strings of at most {MAX_ID_BYTES} bytes")
    if list(participants) != sorted(set(participants)):
        raise SecAggError("participants must be sorted and distinct")


@dataclass(frozen=True)
class RoundContext:
    """run_id, round, the sorted participants selected this round, Shamir threshold, graph degree,
    the graph seed (32 bytes, or None until the advertisements fix it) and the length of the
    uint32 vector being summed.

    The threshold must satisfy  degree/2 < threshold <= degree  (degree as used: rounded up to
    even, at most n-1). The upper bound lets a secret be rebuilt from a device's neighbours; the
    lower bound is what keeps a device's input hidden from a server that lies about who dropped:
    any two sets of `threshold` neighbours share an honest neighbour, who answers one unmask
    request only, so the server never gets both the self-mask seed and the mask key of a device.
    """

    run_id: str
    round: int
    participants: tuple[str, ...]
    threshold: int
    degree: int
    graph_seed: bytes | None
    vector_length: int

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise SecAggError("run_id must be a non-empty string")
        for name in ("round", "threshold", "degree", "vector_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SecAggError(f"{name} must be a non-negative int, got {value!r}")
        _check_ids(self.participants)
        if len(self.participants) < 2:
            raise SecAggError(f"participants: need at least 2, got {len(self.participants)}")
        if self.graph_seed is not None and (not isinstance(self.graph_seed, bytes)
                                            or len(self.graph_seed) != GRAPH_SEED_BYTES):
            raise SecAggError(f"graph_seed must be {GRAPH_SEED_BYTES} bytes (or None: not derived yet)")
        if self.vector_length < 1:
            raise SecAggError("vector_length must be at least 1")
        if self.degree < 1:
            raise SecAggError("degree must be at least 1")
        degree = effective_degree(len(self.participants), self.degree)
        if not degree // 2 < self.threshold <= degree:
            raise SecAggError(f"threshold {self.threshold} must satisfy {degree}/2 < threshold <= {degree} "
                              f"(the graph degree used with {len(self.participants)} participants)")

    def _encode(self, seed: bytes) -> bytes:
        return canonical(DOMAIN, self.run_id.encode(), struct.pack(">QQQQ", self.round, self.threshold, self.degree,
                                                                  self.vector_length),
                         seed, *(p.encode() for p in self.participants))

    @cached_property
    def _encoded(self) -> bytes:
        return self._encode(self._seed("encode the round"))

    @cached_property
    def _announced(self) -> bytes:
        return self._encode(b"")

    def _seed(self, action: str) -> bytes:
        if self.graph_seed is None:
            raise SecAggError(f"cannot {action} before the graph seed is derived from the advertisements")
        return self.graph_seed

    def announced_bytes(self) -> bytes:
        """The canonical encoding with an empty graph seed: what the advertisements sign, and the
        graph seed's derivation binds, before the seed exists."""
        return self._announced

    def with_graph_seed(self, seed: bytes) -> RoundContext:
        """This context with the graph seed derived from the round's advertisements."""
        return replace(self, graph_seed=seed)

    def bytes(self) -> bytes:
        """The canonical encoding of every field: AEAD data, HKDF info and the survivor signatures'
        prefix (encoded once: every share, pairwise seed and signature of the round binds it).
        SecAggError before the graph seed is derived."""
        return self._encoded

    @cached_property
    def graph(self) -> dict[str, frozenset[str]]:
        """Each participant's neighbours in this round's sparse graph (SecAggError before the seed is derived)."""
        return neighbours(self.participants, self.degree, self._seed("draw the graph"))

    def neighbours_of(self, client_id: str) -> frozenset[str]:
        """The neighbours of `client_id`; SecAggError when it does not take part in this round."""
        if client_id not in self.graph:
            raise SecAggError(f"{client_id!r} is not a participant of this round")
        return self.graph[client_id]

    @cached_property
    def _share_xs(self) -> dict[str, int]:
        return {client_id: index for index, client_id in enumerate(self.participants, start=1)}

    def share_x(self, client_id: str) -> int:
        """The Shamir x-coordinate of the shares `client_id` holds: its 1-based index in participants."""
        if client_id not in self._share_xs:
            raise SecAggError(f"{client_id!r} is not a participant of this round")
        return self._share_xs[client_id]

"""Local training only, server side: there is no global state.

Nothing goes down (TRAIN and EVALUATE carry no arrays) and a reply must carry no arrays (only
metrics); the server only paces the rounds and collects the evaluations.
"""

from __future__ import annotations

from edge_sdk.params import ArraySpec
from edge_sdk.protocol import ArrayGroup

from .base import ServerAlgorithm


class LocalServer(ServerAlgorithm):
    id = "local"
    unshardable = "it aggregates nothing (there is no global state to sum)"
    asynchronous = "it aggregates nothing: every device trains alone"

    def initial_state(self) -> dict[str, ArrayGroup]:
        return {}

    def update_spec(self, round_: int) -> dict[str, ArraySpec]:
        return {}

    def begin_round(self, round_: int) -> None:
        """Nothing to reset."""

    def accumulate(self, client_id, groups, metrics, weight) -> None:
        """Nothing to fold in: a reply carries metrics only."""

    def end_round(self, round_: int) -> None:
        """The (empty) global state does not change."""


SERVER = LocalServer

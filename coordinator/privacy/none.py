"""`NoPrivacy`: the run privacy of a run without `--dp`, with `RunPrivacy`'s interface.

The round players ask the run's privacy the same questions whether or not the run is private;
without DP every answer is the plain one (no budget, no noise, the seeded selection of
`fraction` of the candidates, nothing recorded), so they need no `if privacy` of their own.
"""

from __future__ import annotations

from typing import Any

from ..rounds.collector import select_clients


class NoPrivacy:
    """No DP: nothing is checked, noised or accounted."""

    private = False
    distributed = False
    releases_evaluations = False
    devices_noise_evaluations = False
    released_accuracy: float | None = None

    def __init__(self, fraction: float, seed: int):
        self.fraction, self.seed = fraction, seed

    def check_budget(self, population: int) -> None:
        """No budget to spend."""

    def check_evaluation(self, what: str) -> None:
        """Every evaluation may release its figures."""

    def select(self, candidates: list[str], round_: int) -> list[str]:
        """The round's seeded sample of `fraction` of the candidates."""
        return select_clients(candidates, self.fraction, self.seed, round_)

    def aggregator(self, population: int, round_: int) -> None:
        """No noised mean: the algorithm aggregates as it would."""
        return None

    def task_config(self, population: int) -> dict[str, Any]:
        return {}

    def note_upload(self, client_id: str, msg_id: str) -> None:
        """Uploads are not counted."""

    def note_update(self, metrics: dict[str, Any]) -> None:
        """No within-clip report to take."""

    def note_secure_sum(self, count: int) -> None:
        """No noise share to scale."""

    def round_ended(self, population: int, participants: list[str], round_: int) -> None:
        """Nothing to compose."""

    def release_accuracy(self, accuracies: list[float], round_: int) -> float | None:
        return None

    def record(self) -> None:
        """A round's record says no privacy."""
        return None

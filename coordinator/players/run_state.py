"""The run's state on disk: resumed from its checkpoint, checkpointed after each round.

Killed and restarted with the same `--out`, a run resumes after the last checkpointed round
(`resume`: same settings or refused, its DP accountant restored, the rounds checkpointed but not
yet in metrics.jsonl written there); `RunState.checkpoint` saves the algorithm's state with the
run's history (rounds, events, DP, warm start) and its wall time over every incarnation.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..run import checkpoint, warm_start

if TYPE_CHECKING:
    from ..algorithms.base import ServerAlgorithm
    from ..config.run_config import RunConfig
    from ..fleet.outbox import RunPosition
    from ..privacy.run import RunPrivacy
    from ..run.folder import RunFolder
    from ..run.ledger import Ledger
    from ..run.report_files import MetricsLog

log = logging.getLogger(__name__)


def run_record(config: RunConfig) -> dict[str, Any]:
    """The run's configuration as its checkpoint records it: every setting by its flat key,
    and the task the run resolved."""
    return {**config.to_flat(), "task": config.task().to_plain()}


def resume(config: RunConfig, folder: RunFolder, position: RunPosition, algorithm: ServerAlgorithm,
           privacy: RunPrivacy | None, metrics: MetricsLog) -> dict[str, Any] | None:
    """Take up the run checkpointed in `folder` (its id, rounds, state and DP) and return its
    history; None when there is none."""
    saved = checkpoint.load(folder.checkpoint)
    if saved is None:
        return None
    if saved.fingerprint != config.fingerprint():
        raise checkpoint.CheckpointError(
            f"{folder.path} holds run {saved.run_id} with other settings; use another --out to start a new run"
        )
    position.run_id, position.completed = saved.run_id, saved.round
    algorithm.state = saved.state
    if privacy is not None:
        privacy.restore(saved.history["privacy"])
    for record in saved.history["rounds"]:  # a crash between checkpoint and log line
        metrics.append({"event": "round", **record})
    log.info("resuming run %s after round %d of %d", position.run_id, position.completed, config.training.rounds)
    return saved.history


class RunState:
    """Saves the run's checkpoint and keeps its wall time."""

    def __init__(self, config: RunConfig, folder: RunFolder, position: RunPosition, algorithm: ServerAlgorithm,
                 privacy: RunPrivacy | None, ledger: Ledger, init_from: dict[str, Any] | None):
        self.config, self.folder, self.position, self.algorithm = config, folder, position, algorithm
        self.privacy, self.ledger, self.init_from = privacy, ledger, init_from
        self.started = time.time()

    def record(self) -> dict[str, Any]:
        return run_record(self.config)

    def checkpoint(self) -> None:
        history = {**self.ledger.to_history(self.wall_seconds()), "config": self.record()}
        if self.privacy is not None:
            history["privacy"] = self.privacy.to_state()
        if self.init_from is not None:
            history[warm_start.KEY] = self.init_from
        checkpoint.save(
            self.folder.checkpoint,
            checkpoint.Checkpoint(self.position.run_id, self.position.completed, self.config.fingerprint(),
                                  self.algorithm.state, history),
        )

    def wall_seconds(self) -> float:
        """The run's wall time over every incarnation so far."""
        return self.ledger.base_wall_seconds + time.time() - self.started

"""Local training only: the no-federation baseline.

Every client trains its own model with cross-entropy (SGD, the run's settings) and never
communicates parameters. Partition: nothing shared, everything personal (BatchNorm statistics
included).

Up: metrics only (no arrays). Down: nothing (the TRAIN and EVALUATE messages carry no arrays).
Deployed model: the client's own model.
"""

from __future__ import annotations

from .base import FitResult, Task
from .part_sharing import PartSharingDevice


class LocalDevice(PartSharingDevice):
    id = "local"
    display_name = "Local"
    citation = None
    table_rank = 10
    shared_parts = ()

    def fit(self, task: Task) -> FitResult:
        loss = self.train_locally(task)
        return FitResult({}, {"num_examples": len(self.train_y), "loss": loss})


DEVICE = LocalDevice

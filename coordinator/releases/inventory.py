"""Which release each weak device runs: `releases/inventory.json`, kept by the release service.

An entry per device: the version (and sha256) whose model it deploys, the accuracy that model
scored on the device's own data, the version it evaluated last and how that scored, why it kept
an older one when it did, and when it last reported. The training run starts it with its final
evaluation; `edgepfl release serve` updates it from every evaluation a weak device sends;
`edgepfl release list` and the live view show it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_sdk.store import write_atomic

from .store import ReleaseStore

if TYPE_CHECKING:
    from .phase import Release


class Inventory:
    """The inventory file of a run's releases (`<run_dir>/releases/inventory.json`)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "releases" / "inventory.json"
        self.devices: dict[str, dict[str, Any]] = (json.loads(self.path.read_text()) if self.path.is_file()
                                                   else {})

    def record(self, device: str, *, runs: int | None, runs_sha256: str | None, accuracy: float | None,
               evaluated: int, evaluated_accuracy: float | None, kept: str | None) -> None:
        """What `device` reported of an evaluation of release `evaluated`, written at once."""
        self.devices[device] = {"runs": runs, "sha256": runs_sha256, "accuracy": accuracy, "evaluated": evaluated,
                                "evaluated_accuracy": evaluated_accuracy, "kept": kept, "reported": time.time()}
        write_atomic(self.path, json.dumps(self.devices, indent=2, sort_keys=True).encode())

    def runs(self, device: str) -> int | None:
        """The version `device` runs, as it last reported (None: unknown)."""
        return self.devices.get(device, {}).get("runs")

    def accuracy_with(self, device: str, version: int) -> float | None:
        """The accuracy `device` last reported with release `version`, if it did."""
        entry = self.devices.get(device, {})
        if entry.get("runs") == version and entry.get("accuracy") is not None:
            return float(entry["accuracy"])
        if entry.get("evaluated") == version and entry.get("evaluated_accuracy") is not None:
            return float(entry["evaluated_accuracy"])
        return None


def keep_release_results(run_dir: str | Path, release: Release, final: Mapping[str, Mapping[str, Any]]) -> None:
    """What the training run's final evaluation says of its release: the weak devices' mean
    accuracy on the version's manifest, and each weak device's entry in the inventory."""
    if release.version is None:
        return
    inventory = Inventory(run_dir)
    accuracies = []
    for device, result in sorted(final.items()):
        accuracy = result.get("accuracy")
        if result.get("kind") != "lite" or not isinstance(accuracy, (int, float)):
            continue
        accuracies.append(float(accuracy))
        inventory.record(device, runs=release.version, runs_sha256=release.sha256, accuracy=float(accuracy),
                         evaluated=release.version, evaluated_accuracy=float(accuracy), kept=None)
    ReleaseStore(run_dir).set_accuracy(release.version, sum(accuracies) / len(accuracies) if accuracies else None)

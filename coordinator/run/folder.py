"""The files a run leaves in its folder (`--out`), named in one place.

The coordinator, the simulation, `edgepfl export`, the benchmarks and the tests all find a
run's checkpoint, metrics, report, release and the simulated devices' state through a
`RunFolder`, so a file is renamed or moved here and nowhere else.
"""

from __future__ import annotations

from pathlib import Path


class RunFolder:
    """Paths of one run's files under `path`; nothing is created or read here."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def checkpoint(self) -> Path:
        """The coordinator's state after the last completed round (msgpack, atomic)."""
        return self.path / "checkpoint.msgpack"

    @property
    def metrics(self) -> Path:
        """One JSON line per round and per event (release, final evaluation)."""
        return self.path / "metrics.jsonl"

    @property
    def report(self) -> Path:
        """The run's summary, written when the run ends."""
        return self.path / "report.json"

    @property
    def curves(self) -> Path:
        """Accuracy and cumulative traffic per round, plotted with the report."""
        return self.path / "curves.png"

    @property
    def release_dir(self) -> Path:
        """Where the released representation is exported."""
        return self.path / "release"

    @property
    def release(self) -> Path:
        """The released representation (ONNX) that weak devices fetch."""
        return self.release_dir / "representation.onnx"

    @property
    def body_statistics(self) -> Path:
        """The global body's BatchNorm statistics pooled from the devices for the release (.npz)."""
        return self.path / "body_statistics.npz"

    @property
    def state_dir(self) -> Path:
        """The simulated devices' personal state, one folder per device."""
        return self.path / "state"

    def device_state(self, client_id: str) -> Path:
        """The personal state folder of simulated device `client_id`."""
        return self.state_dir / client_id

    @property
    def models_dir(self) -> Path:
        """The simulated weak devices' personalized models, one ONNX file per device."""
        return self.path / "models"

    def device_identity(self, client_id: str) -> Path:
        """Simulated device `client_id`'s secure-aggregation identity key (secure runs)."""
        return self.device_state(client_id) / "secagg-identity.key"

    @property
    def secagg_roster(self) -> Path:
        """Every simulated device's public identity key (secure runs)."""
        return self.path / "secagg-roster.json"

    def device_model(self, client_id: str) -> Path:
        """The personalized model weak device `client_id` writes."""
        return self.models_dir / f"{client_id}.onnx"

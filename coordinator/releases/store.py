"""Numbered releases kept under a run folder, and which one the fleet should run.

Every representation a run releases, or an operator publishes into it later, becomes a version
`releases/<n>/` (n = 1, 2, ...): the ONNX bytes and a manifest (sha256, size, the source run
and round, the accuracy it reached when released, when). `releases/state.json` says which
version is current, the staged rollout under way (if any) and the history of what happened
(published, promoted, rolled back, with the reason). The operator's commands (`edgepfl release
promote | rollback | publish`) and the release service (`edgepfl release serve`) both change
that file, one at a time under a lock file, so a command given while the service runs is picked
up by it. Files are replaced atomically: a crash leaves the old file or the new one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from edge_sdk.store import write_atomic

MODEL = "representation.onnx"
MANIFEST = "manifest.json"


class ReleaseError(ValueError):
    """A release command that cannot be carried out; the message says why and what to do."""


@dataclass(frozen=True)
class ReleaseVersion:
    """One numbered release: its manifest as `releases/<n>/manifest.json` holds it."""

    version: int
    sha256: str
    size: int
    metadata: dict[str, Any]
    source: dict[str, Any]
    """The run (`run_id`, `round`, `folder`) or file it came from."""
    accuracy: float | None
    """The weak devices' mean accuracy with it when it was released (None: not measured)."""
    created: float

    def manifest(self, *, rollback: bool = False) -> dict[str, Any]:
        """The RELEASE manifest devices receive: the training run's fields, the version, and
        `rollback` when the fleet goes back to it."""
        manifest = {"sha256": self.sha256, "size": self.size, "format": "onnx", "metadata": self.metadata,
                    "version": self.version}
        return manifest | {"rollback": True} if rollback else manifest


@dataclass
class Rollout:
    """A staged rollout: `candidate` goes to `canaries` first; promoted when their accuracy
    holds (within `tolerance`) against what they scored with the current release."""

    candidate: int
    fraction: float
    tolerance: float
    started: float
    canaries: list[str] = field(default_factory=list)
    """Chosen by the service when it starts the rollout (empty until then)."""
    results: dict[str, dict[str, float]] = field(default_factory=dict)
    """canary -> {"candidate": accuracy with the candidate, "current": accuracy with the current}."""

    def verdict(self, current: int) -> tuple[bool, str]:
        """Promote (True) or roll back, and why: the canaries' mean accuracy with the candidate
        against their mean with release `current`, on their own data."""
        if not self.results:
            return False, f"no canary reported on release {self.candidate}"
        candidate = sum(r["candidate"] for r in self.results.values()) / len(self.results)
        before = sum(r["current"] for r in self.results.values()) / len(self.results)
        holds = candidate >= before - self.tolerance
        return holds, (f"{len(self.results)} canaries scored {candidate:.4f} with release {self.candidate} against "
                       f"{before:.4f} with release {current} ({'within' if holds else 'beyond'} the tolerance "
                       f"{self.tolerance:g})")


@dataclass
class ReleaseState:
    """`releases/state.json`: the current version, the rollout under way, the history."""

    current: int | None = None
    rollout: Rollout | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def note(self, action: str, version: int | None, reason: str) -> None:
        self.history.append({"time": time.time(), "action": action, "version": version, "reason": reason})

    def to_json(self) -> dict[str, Any]:
        return {"current": self.current, "rollout": asdict(self.rollout) if self.rollout else None,
                "history": self.history}

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> ReleaseState:
        rollout = document.get("rollout")
        return cls(document.get("current"), Rollout(**rollout) if rollout else None, list(document.get("history", [])))


class ReleaseStore:
    """The releases of the run in `run_dir` (`<run_dir>/releases/`)."""

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir) / "releases"

    def path(self, version: int) -> Path:
        """The ONNX file of `version`."""
        return self.dir / str(version) / MODEL

    def versions(self) -> list[ReleaseVersion]:
        """Every version, oldest first."""
        if not self.dir.is_dir():
            return []
        numbers = sorted(int(entry.name) for entry in self.dir.iterdir() if entry.name.isdigit())
        return [self.get(number) for number in numbers]

    def get(self, version: int) -> ReleaseVersion:
        manifest = self.dir / str(version) / MANIFEST
        if not manifest.is_file():
            known = ", ".join(str(v.version) for v in self.versions()) or "none"
            raise ReleaseError(f"release {version} does not exist in {self.dir} (versions: {known})")
        return ReleaseVersion(**json.loads(manifest.read_text()))

    def data(self, version: int) -> bytes:
        """The bytes of `version`, checked against its manifest's sha256."""
        entry = self.get(version)
        data = self.path(version).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ReleaseError(f"{self.path(version)} does not match its manifest's sha256: the file was changed")
        return data

    def add(self, data: bytes, metadata: dict[str, Any], source: dict[str, Any], accuracy: float | None,
            reason: str) -> ReleaseVersion:
        """Keep `data` as the next version (the latest again when its bytes are the latest's: a
        run that released twice after a crash adds one version). The first version becomes current."""
        sha = hashlib.sha256(data).hexdigest()
        with self.state() as state:
            existing = self.versions()
            if existing and existing[-1].sha256 == sha:
                return existing[-1]
            entry = ReleaseVersion(len(existing) + 1 if not existing else existing[-1].version + 1, sha, len(data),
                                   metadata, source, accuracy, time.time())
            write_atomic(self.path(entry.version), data)
            write_atomic(self.dir / str(entry.version) / MANIFEST, json.dumps(asdict(entry), indent=2).encode())
            state.note("published", entry.version, reason)
            if state.current is None:
                state.current = entry.version
                state.note("promoted", entry.version, "the first release")
            return entry

    def set_accuracy(self, version: int, accuracy: float | None) -> None:
        """Record the weak devices' mean accuracy with `version` when it was released."""
        entry = replace(self.get(version), accuracy=accuracy)
        write_atomic(self.dir / str(version) / MANIFEST, json.dumps(asdict(entry), indent=2).encode())

    def current(self) -> ReleaseVersion | None:
        """The version the fleet should run (None before any release)."""
        number = self.read_state().current
        return None if number is None else self.get(number)

    def read_state(self) -> ReleaseState:
        path = self.dir / "state.json"
        return ReleaseState.from_json(json.loads(path.read_text())) if path.is_file() else ReleaseState()

    @contextmanager
    def state(self) -> Iterator[ReleaseState]:
        """The state, to change: read under the lock, written back (atomically) when the block ends."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.read_state()
            yield state
            write_atomic(self.dir / "state.json", json.dumps(state.to_json(), indent=2).encode())

    # -- the operator's commands -----------------------------------------------------------
    def request_rollout(self, version: int, fraction: float, tolerance: float) -> None:
        """Stage `version`: the release service sends it to `fraction` of the weak devices first."""
        if not 0.0 < fraction <= 1.0:
            raise ReleaseError(f"--fraction {fraction}: give a fraction of the weak devices in (0, 1]")
        if tolerance < 0.0:
            raise ReleaseError(f"--tolerance {tolerance}: give an accuracy drop >= 0")
        self.get(version)
        with self.state() as state:
            if state.current == version:
                raise ReleaseError(f"release {version} is already the current one")
            if state.rollout is not None:
                raise ReleaseError(f"release {state.rollout.candidate} is being rolled out; wait for its outcome "
                                   "(edgepfl release list) or roll back")
            state.rollout = Rollout(version, fraction, tolerance, time.time())
            state.note("staged", version, f"to {fraction:.0%} of the weak devices first, tolerance {tolerance:g}")

    def roll_back(self, reason: str) -> int:
        """Make the release that was current before the current one current again (ending a
        rollout under way); returns its version."""
        with self.state() as state:
            if state.rollout is not None:
                candidate, state.rollout = state.rollout.candidate, None
                state.note("rolled back", candidate, reason)
                return state.current if state.current is not None else candidate
            previous = self._previous(state)
            if previous is None:
                raise ReleaseError("no earlier release was ever current: nothing to roll back to")
            state.note("rolled back", state.current, reason)
            state.current = previous
            state.note("promoted", previous, "roll back")
            return previous

    @staticmethod
    def _previous(state: ReleaseState) -> int | None:
        """The version current before the current one (promotions, newest first)."""
        promoted = [entry["version"] for entry in state.history if entry["action"] == "promoted"]
        for version in reversed(promoted):
            if version != state.current:
                return version
        return None

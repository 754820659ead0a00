"""What a weak device deploys, and whether a newly evaluated release replaces it.

A device runs one personalized model at a time. Its `Deployment` says which release (sha256,
version) the model was composed from, the accuracy it scored on the device's own data, the
head kind and the model's path. The record is kept as JSON in the device's state folder
(`deployed-<device id>.json`, written atomically), so a restarted device still knows what it
runs and how well it scored; a damaged record is logged and read as none.

A newly evaluated release replaces the deployed one unless it scores strictly lower on the
device's own data (`kept_because`). An operator's rollback is followed even when it scores
lower, and a refit of the release the device runs (a later EVALUATE of the same release, with
the pooled prototypes) replaces its own model. No torch, scikit-learn or onnx here.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..store import write_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deployment:
    """The personalized model a device runs, and the release it was composed from."""

    sha256: str
    version: int | None
    accuracy: float
    head: str
    model_path: str

    @classmethod
    def from_plain(cls, plain: Any) -> Deployment:
        """A record read back from JSON; ValueError naming the field that is wrong."""
        if not isinstance(plain, dict):
            raise ValueError("a deployment record is a JSON object")
        checks = {"sha256": lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None,
                  "version": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                  "accuracy": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0,
                  "head": lambda v: isinstance(v, str),
                  "model_path": lambda v: isinstance(v, str) and v != ""}
        for name, valid in checks.items():
            if name not in plain or not valid(plain[name]):
                raise ValueError(f"deployment field {name!r} is {plain.get(name)!r}")
        return cls(plain["sha256"], plain["version"], float(plain["accuracy"]), plain["head"], plain["model_path"])

    def describe(self) -> str:
        """The release it runs, as logs and reasons name it."""
        return describe_release(self.sha256, self.version)


def describe_release(sha256: str, version: int | None) -> str:
    """A release as logs name it: its sha256 prefix, and its version when known."""
    return sha256[:12] if version is None else f"{version} ({sha256[:12]})"


def read_deployment(path: Path, model_path: Path) -> Deployment | None:
    """The record at `path`, or None when there is none. A record that cannot be read, or whose
    model is not the file at `model_path`, is logged (WARNING) and read as none."""
    if not path.exists():
        return None
    try:
        deployment = Deployment.from_plain(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        log.warning("%s is damaged (%s): starting as if nothing were deployed", path, exc)
        return None
    if Path(deployment.model_path) != model_path or not model_path.is_file():
        log.warning("%s names the model %s, which is not the file at %s: starting as if nothing were deployed",
                    path, deployment.model_path, model_path)
        return None
    return deployment


def write_deployment(path: Path, deployment: Deployment) -> None:
    """Keep `deployment` at `path`, atomically."""
    write_atomic(path, json.dumps(asdict(deployment), indent=1).encode())


def kept_because(deployed: Deployment | None, sha256: str, accuracy: float, *, rollback: bool,
                 private: bool = False) -> str | None:
    """Why the device keeps `deployed` instead of the release `sha256` that scored `accuracy`
    (None: deploy it). Under DP (`private`) the reason names no accuracy: it goes upstream."""
    if deployed is None or rollback or deployed.sha256 == sha256 or accuracy >= deployed.accuracy:
        return None
    if private:
        return f"scored lower than release {deployed.describe()} on its own data"
    return f"scored {accuracy:.3f} < {deployed.accuracy:.3f} on its own data"

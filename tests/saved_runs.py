"""What a finished run saved, for the tests that read it back."""

from __future__ import annotations

from pathlib import Path

from coordinator.run.checkpoint import Checkpoint, load


def checkpoint_at(path: Path) -> Checkpoint:
    """The checkpoint at `path`, which the run must have left (`load` gives None where there is none)."""
    saved = load(path)
    assert saved is not None, f"no checkpoint at {path}"
    return saved

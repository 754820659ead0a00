"""Atomic checkpoints of the coordinator's state after every completed round.

The file is msgpack in the wire's array encoding (never pickle): run id, the round completed,
the configuration fingerprint, the algorithm's global state and the run's history. It is
written to a temporary file, fsynced and renamed, so a crash leaves the old or the new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_sdk import wire
from edge_sdk.protocol import ArrayGroup, ProtocolError
from edge_sdk.store import write_atomic

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run."""


@dataclass
class Checkpoint:
    run_id: str
    round: int
    fingerprint: str
    state: dict[str, ArrayGroup]
    history: dict[str, Any] = field(default_factory=dict)


def save(path: Path, checkpoint: Checkpoint) -> None:
    document = {
        "format": FORMAT,
        "run_id": checkpoint.run_id,
        "round": checkpoint.round,
        "fingerprint": checkpoint.fingerprint,
        "state": {g: {k: wire.encode_array(v) for k, v in arrays.items()} for g, arrays in checkpoint.state.items()},
        "history": checkpoint.history,
    }
    pieces: list[bytes | memoryview] = []
    wire.pack_pieces(document, pieces)  # the arrays go to the file without a copy of the state
    write_atomic(path, pieces)


def load(path: Path) -> Checkpoint | None:
    """The checkpoint at `path`, None if there is none, CheckpointError if it is unreadable."""
    if not path.exists():
        return None
    try:
        document = wire.unpack(path.read_bytes(), wire.WireLimits(max_message_bytes=8 << 30))
        if document.get("format") != FORMAT:
            raise CheckpointError(f"{path}: unsupported checkpoint format {document.get('format')!r}")
        state = {
            group: {key: wire.decode_array(f"{group}/{key}", raw).copy() for key, raw in arrays.items()}
            for group, arrays in document["state"].items()
        }
        return Checkpoint(document["run_id"], document["round"], document["fingerprint"], state, document["history"])
    except (KeyError, TypeError, AttributeError, ProtocolError) as exc:
        raise CheckpointError(f"{path} is not a valid checkpoint: {exc}") from None

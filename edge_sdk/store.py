"""A device's personal state on its own disk: written atomically, reloaded after a restart.

The file holds the run id, the algorithm, the last round trained and the personal arrays in the
wire's array encoding (msgpack, never pickle). It never leaves the device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import msgpack

from . import wire
from .protocol import ArrayGroup, ProtocolError

log = logging.getLogger(__name__)


@dataclass
class PersonalState:
    run_id: str
    algorithm: str
    round: int
    arrays: ArrayGroup


def write_atomic(path: Path, data: bytes | list[bytes | memoryview]) -> None:
    """Write bytes, or consecutive pieces of them (never joined in memory), so that readers see
    the old file or the complete new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.writelines(data if isinstance(data, list) else [data])
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class PersonalStore:
    """`<state_dir>/personal.msgpack`, replaced atomically on every save."""

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        self.path = self.dir / "personal.msgpack"

    def save(self, state: PersonalState) -> None:
        document = {
            "run_id": state.run_id,
            "algorithm": state.algorithm,
            "round": state.round,
            "arrays": {k: wire.encode_array(v) for k, v in state.arrays.items()},
        }
        write_atomic(self.path, msgpack.packb(document, use_bin_type=True))

    def load(self) -> PersonalState | None:
        """The saved state, or None if there is none or it cannot be read (logged)."""
        if not self.path.exists():
            return None
        try:
            document = wire.unpack(self.path.read_bytes(), wire.WireLimits(max_message_bytes=4 << 30))
            arrays = {k: wire.decode_array(k, v).copy() for k, v in document["arrays"].items()}
            return PersonalState(str(document["run_id"]), str(document["algorithm"]), int(document["round"]), arrays)
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            log.warning("ignoring unreadable personal state %s: %s", self.path, exc)
            return None

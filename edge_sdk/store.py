"""A device's personal state on its own disk: written atomically, reloaded after a restart.

The file is named after the device (`<state_dir>/personal-<device id>.msgpack`), so devices that
share a state folder keep apart, and it holds the device id, the run id, the algorithm, the last
round trained and the personal arrays in the wire's array encoding (msgpack, never pickle). A
state written by another device or for another run is refused with a logged reason, never
loaded. It never leaves the device.
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
    client_id: str
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
    """Device `client_id`'s `<state_dir>/personal-<client_id>.msgpack`, replaced atomically on every save."""

    def __init__(self, state_dir: str | Path, client_id: str):
        self.dir = Path(state_dir)
        self.client_id = client_id
        self.path = self.dir / f"personal-{client_id}.msgpack"

    def save(self, state: PersonalState) -> None:
        if state.client_id != self.client_id:
            raise ValueError(f"personal state of device {state.client_id!r} given to the store of {self.client_id!r}")
        document = {
            "client_id": state.client_id,
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
            return PersonalState(str(document["client_id"]), str(document["run_id"]), str(document["algorithm"]),
                                 int(document["round"]), arrays)
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            log.warning("ignoring unreadable personal state %s: %s", self.path, exc)
            return None

    def restore(self, run_id: str, algorithm: str) -> PersonalState | None:
        """The saved state if it is this device's, for run `run_id` and `algorithm`; otherwise
        None, with the reason logged (another device's state is an error: it is never loaded)."""
        saved = self.load()
        if saved is None:
            return None
        if saved.client_id != self.client_id:
            log.error("%s holds the personal state of device %s, not of %s: refused (give each device its own "
                      "--state-dir)", self.path, saved.client_id, self.client_id)
            return None
        if (saved.run_id, saved.algorithm) != (run_id, algorithm):
            log.warning("%s: personal state of run %s (%s) is not of run %s (%s): not restored", self.client_id,
                        saved.run_id, saved.algorithm, run_id, algorithm)
            return None
        return saved

"""Downlink codecs: a TRAIN carries the change since the state a device already holds.

Under `downlink_codec` fp16 or int8 the coordinator sends each float array as its change from
the state of the TRAIN before (`base`), encoded as the upload codecs encode a change
(`codecs.encode`); a device holding that state adds the change back (`reconstruct`), exactly as
the coordinator does, so both hold the same arrays bit for bit. A TRAIN's `config.downlink` says
which: {"codec": "full", "version": r} (the whole state) or {"codec", "base", "version"} (a
change). A device that does not hold `base` asks for the full state (`HeldState.receive`).
Pure functions and a small holder: no broker here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import codecs
from .protocol import ArrayGroup, Envelope, Reason, ValidationError
from .settings import DOWNLINK_CODECS

DOWNLINK = "downlink"
"""The TRAIN config key that says how its groups are encoded."""
STATE = "state"
"""The FETCH config key naming the state version a device asks for in full."""
FULL = "full"

Layout = tuple[tuple[str, str, tuple[int, ...], str], ...]


def layout(groups: dict[str, ArrayGroup]) -> Layout:
    """Every array's group, name, shape and dtype, in order: what a change needs to match."""
    return tuple((group, name, tuple(array.shape), array.dtype.str)
                 for group in sorted(groups) for name, array in sorted(groups[group].items()))


def copied(groups: dict[str, ArrayGroup]) -> dict[str, ArrayGroup]:
    """A copy of `groups` that later changes of the original do not reach."""
    return {group: {name: np.array(array, copy=True) for name, array in arrays.items()}
            for group, arrays in groups.items()}


def encode(codec: str, groups: dict[str, ArrayGroup], held: dict[str, ArrayGroup]) -> dict[str, ArrayGroup]:
    """`groups` as their change from `held` under `codec` (fp16 or int8): each float array's
    change in float16, or in int8 with a float32 `<name>#scale`; other arrays as they are."""
    if codec not in DOWNLINK_CODECS or codec == FULL:
        raise ValueError(f"downlink codec must be fp16 or int8, got {codec!r}")
    return codecs.encode(codec, groups, held)


def reconstruct(codec: str, encoded: dict[str, ArrayGroup], held: dict[str, ArrayGroup]) -> dict[str, ArrayGroup]:
    """The state a change `encoded` under `codec` leads to from `held`: per float array,
    held + the decoded change, added in float32 and cast to the held array's dtype; other arrays
    as received. ValidationError when the result's layout is not `held`'s."""
    if codec not in DOWNLINK_CODECS or codec == FULL:
        raise ValidationError(Reason.MALFORMED, f"downlink codec {codec!r} carries no change")
    expected = {group: {name: (tuple(array.shape), array.dtype.str) for name, array in arrays.items()}
                for group, arrays in held.items()}
    state = codecs.decode(codec, encoded, held, expected)
    if layout(state) != layout(held):
        raise ValidationError(Reason.UNEXPECTED_ARRAYS, "a downlink change whose arrays are not the held state's")
    return state


@dataclass(frozen=True)
class Announced:
    """A TRAIN's `config.downlink`: its codec, the version it produces and the one it changes."""

    codec: str
    version: int
    base: int | None = None

    def plain(self) -> dict[str, Any]:
        """As TRAIN's config carries it."""
        out: dict[str, Any] = {"codec": self.codec, "version": self.version}
        if self.base is not None:
            out["base"] = self.base
        return out

    @classmethod
    def of(cls, config: dict[str, Any]) -> Announced | None:
        """The `downlink` of a TRAIN's config (None without one); ValidationError when malformed."""
        value = config.get(DOWNLINK)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValidationError(Reason.MALFORMED, "TRAIN config.downlink is not a map")
        codec, version, base = value.get("codec"), value.get("version"), value.get("base")
        if (codec not in DOWNLINK_CODECS or not isinstance(version, int) or not _count(version)
                or (base is not None and not _count(base))):
            raise ValidationError(Reason.MALFORMED, f"TRAIN config.downlink is malformed: {value!r}"[:300])
        if (codec == FULL) != (base is None):
            raise ValidationError(Reason.MALFORMED, "TRAIN config.downlink: a change names its base, the full "
                                                    "state none")
        return cls(codec, version, base)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class HeldState:
    """What a device holds of the shared state: the arrays of the last TRAIN it reconstructed,
    their run and version."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.version = -1
        self.groups: dict[str, ArrayGroup] | None = None

    def receive(self, train: Envelope) -> Envelope | None:
        """`train` with the full state in its groups (kept as held), or None when it is a change
        from a state this device does not hold: it must ask for the full state."""
        announced = Announced.of(train.config)
        if announced is None:
            return train
        if announced.base is None:
            self._hold(train.run_id, announced.version, copied(train.groups))
            return train
        if self.groups is None or self.run_id != train.run_id or self.version != announced.base:
            return None
        state = reconstruct(announced.codec, train.groups, self.groups)
        self._hold(train.run_id, announced.version, state)
        return replace(train, groups=copied(state))  # training never reaches what is held

    def _hold(self, run_id: str, version: int, groups: dict[str, ArrayGroup]) -> None:
        self.run_id, self.version, self.groups = run_id, version, groups

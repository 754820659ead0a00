"""The coordinator's side of the downlink codec: what every up-to-date device holds.

`Downlink` keeps `held`, the shared state exactly as a device reconstructs it from the TRAINs
sent so far, and its version (the round of the TRAIN that produced it). Each round's TRAIN goes
down as its change from `held` when the layout is unchanged, else in full; `held` then becomes
what a device decodes (so the quantization error of one round is corrected by the next one's
change, never accumulated). Every check of what devices trained from uses `held`. A device
lacking the base asks for the state by version (FETCH `state`), answered with the same TRAIN in
full on its own topic.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from edge_sdk import downlink
from edge_sdk.config import ConfigError
from edge_sdk.downlink import DOWNLINK, FULL, Announced
from edge_sdk.protocol import ArrayGroup, Envelope

if TYPE_CHECKING:
    from ..config.run_config import RunConfig


def check_downlink_run(config: RunConfig) -> None:
    """Refuse by name (ConfigError) a lossy downlink codec where the TRAIN's arrays are used as
    the reference elsewhere than here: asynchronous runs, shards, secure aggregation."""
    if config.training.downlink_codec == FULL:
        return
    refusals = [
        (config.round.mode == "async", "mode async sends each device its own state version: use full"),
        (config.round.shards > 0, "shards check and sum the updates against the TRAIN's arrays: use full"),
        (config.secagg.secure_aggregation, "secure_aggregation: use full"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"downlink_codec {config.training.downlink_codec}: {why}")


class Downlink:
    """The held state and how each round's TRAIN carries the shared state."""

    def __init__(self, codec: str):
        self.codec = codec
        self.held: dict[str, ArrayGroup] | None = None
        self.version = 0

    def prepare(self, round_: int, groups: dict[str, ArrayGroup]) -> tuple[dict[str, ArrayGroup],
                                                                           dict[str, ArrayGroup], dict | None]:
        """Round `round_`'s shared state `groups` as TRAIN carries it: (the groups to send, the
        state devices reconstruct from them, now held, and `config.downlink`, None under `full`)."""
        if self.codec == FULL:
            return groups, groups, None
        if self.held is not None and downlink.layout(self.held) == downlink.layout(groups):
            sent = downlink.encode(self.codec, groups, self.held)
            announced = Announced(self.codec, round_, self.version)
            self.held = downlink.reconstruct(self.codec, sent, self.held)
        else:
            self.held = downlink.copied(groups)
            sent, announced = self.held, Announced(FULL, round_)
        self.version = round_
        return sent, self.held, announced.plain()

    def full(self, train: Envelope) -> Envelope:
        """`train` carrying the held state in full (for a device's own topic): itself when it
        already does."""
        announced = Announced.of(train.config)
        if announced is None or announced.base is None or self.held is None:
            return train
        return replace(train, groups=self.held,
                       config={**train.config, DOWNLINK: Announced(FULL, announced.version).plain()})

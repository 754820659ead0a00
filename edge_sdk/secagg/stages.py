"""How a secure-aggregation round travels over the edgepfl protocol: stage names and config keys
that the coordinator (coordinator/rounds/secagg.py) and the device (device.py) share.

A round under secure aggregation is five requests and a delivery (docs/PROTOCOL.md, section 19):
SECAGG `advertise` (broadcast: the round's parameters, no graph seed; each selected device
answers SECAGG_RES with its signed keys), SECAGG `share` (broadcast: every advertisement, from
which each device derives the graph seed; each answers with share ciphertexts for its
neighbours), SECAGG `shares` (per device: the ciphertexts addressed to it, no answer), TRAIN
(broadcast; each answers TRAIN_RES carrying only its masked vector), SECAGG `confirm`
(broadcast: the survivor set; each survivor answers with its signature on it) and SECAGG
`unmask` (broadcast: the survivor set, who dropped and the survivors' signatures; each signer
answers with its shares). A device that finds a stage inconsistent answers it with `refused`
(`secagg_inconsistent`) and `detail` instead, and reveals nothing.

The release phase pools sums the same way (pools.py): the advertise stage names the pool
(`POOL`), the EVALUATE of the pool's phase takes TRAIN's place and each EVAL_RES carries the
masked vector of the device's share instead of the share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol import REFUSAL_DETAIL, ProtocolError, Reason
from ..protocol import REFUSED as REFUSED  # a refusal's keys are the protocol's (section 11)

if TYPE_CHECKING:
    import numpy as np

    from ..protocol import ArrayGroup

STAGE = "stage"
ADVERTISE, SHARE, SHARES, CONFIRM, UNMASK = "advertise", "share", "shares", "confirm", "unmask"
"""A device answers all but `shares` (a delivery) with SECAGG_RES."""

SECURE = "secagg"
"""The TRAIN config key (true) of a round under secure aggregation, and the TRAIN_RES group that
carries the masked vector (`MASKED`, int32: the ring's words as two's complement)."""
MASKED = "masked"
CAPABILITY = "secagg"
"""The HELLO config key of a device that speaks secure aggregation, with the version it speaks."""
VERSION = 4
"""2: the advertise stage may carry a group per shard (`GROUPS`); 3: it may name a release pool
(`POOL`), whose shares weak devices mask too; 4: the graph seed is derived from the
advertisements (the advertise stage carries none), and the `confirm` stage comes before `unmask`."""

# the advertise stage's parameters
PARTICIPANTS, THRESHOLD, DEGREE, LENGTH = "participants", "threshold", "degree", "length"
GRAPH_SEED = "graph_seed"
"""What an advertise stage of version 3 carried: the coordinator's choice of graph; refused now."""
CLIP, LARGEST, SUMMANDS = "clip", "largest", "summands"
GROUPS = "groups"
"""In a sharded run: the advertise stage's parameters, one map per shard (each with its own
participants, graph, threshold and summands); a device takes the one that names it."""
PRIVATE = "private"
"""True under distributed DP: the upload was clipped and noised by DP on the device; it goes into
the sum unweighted and not clipped again, each coordinate within `CLIP`."""
POOL, BOUND = "pool", "bound"
"""In the release phase: the pool summed (`statistics` or `prototypes`), and the bound each
coordinate of a device's share is clipped to (pools.py)."""
# the later stages' payloads
ADVERTS, CIPHERTEXTS, SURVIVORS, DROPPED, SIGNATURES = "adverts", "ciphertexts", "survivors", "dropped", "signatures"
ADVERT, SIGNATURE, RESPONSE = "advert", "signature", "response"
DETAIL = REFUSAL_DETAIL
"""A device's SECAGG_RES refusing a stage carries REFUSED (`secagg_inconsistent`) and DETAIL: the
keys of every refusal (docs/PROTOCOL.md section 11)."""


def masked_vector(groups: dict[str, ArrayGroup], what: str) -> np.ndarray:
    """The masked vector (uint32 view) of a secure upload or pool share, whose only array is `SECURE/MASKED`
    (1-D int32); ProtocolError `secagg_invalid` naming `what` otherwise."""
    masked = groups.get(SECURE, {}).get(MASKED) if set(groups) == {SECURE} else None
    if masked is None or set(groups[SECURE]) != {MASKED} or masked.dtype != "int32" or masked.ndim != 1:
        raise ProtocolError(Reason.SECAGG_INVALID, f"{what}: under secure aggregation it carries only "
                                                   f"{SECURE}/{MASKED} (1-D int32)")
    return masked.view("uint32") if masked.flags.c_contiguous else masked.copy().view("uint32")

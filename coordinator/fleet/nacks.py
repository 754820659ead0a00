"""Telling a device why the coordinator refused one of its messages: the NACK, rate-limited.

The coordinator answers a message it refuses with a NACK on the sender's own downstream topic
(`edgepfl/<fed>/down/<id>/nack`) when the sender is a device registered with this coordinator
process and the message reached the coordinator's own checks: it passed the channel's topic,
decoding and sender checks, and its seal where the run signs (`edge_sdk.signing`). The NACK
names the refused message (`in_reply_to`, its msg_id), its kind and the reason code, and
carries nothing of the message itself. What the channel refuses (undecodable bytes, a bad
seal, a sender that does not match its topic, a budget spent) and messages of senders that
never registered get no NACK: a forger learns nothing and cannot make the coordinator publish.

At most one NACK per device, refused kind and reason code per `interval` seconds (default 1 s):
a device that sends a stream of bad messages gets at most one NACK per second for each kind of
message and reason back, however many it sends.
"""

from __future__ import annotations

from collections.abc import Callable

from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Reason


def nack_for(refused_kind: Kind, refused_msg_id: str, reason: Reason, *, run_id: str, round_: int) -> Envelope:
    """The NACK of a refused message: its msg_id, kind and the reason code, nothing of its content."""
    return Envelope(Kind.NACK, COORDINATOR, run_id=run_id, round=round_,
                    config={"in_reply_to": refused_msg_id, "refused_kind": refused_kind.value,
                            "reason": reason.value})


class NackLimiter:
    """Which refusals get a NACK: one per (device, refused kind, reason) per `interval` seconds of `clock`."""

    def __init__(self, clock: Callable[[], float], interval: float = 1.0):
        self.clock = clock
        self.interval = interval
        self._last: dict[tuple[str, str, str], float] = {}  # bounded: registered devices x up kinds x reasons

    def allow(self, device: str, kind: Kind, reason: Reason) -> bool:
        """True (and the NACK counts as sent now) unless `device` got one for a `kind` message
        refused for `reason` within `interval`."""
        now, key = self.clock(), (device, kind.value, reason.value)
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            return False
        self._last[key] = now
        return True

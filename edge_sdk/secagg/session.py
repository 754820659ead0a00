"""A device session that speaks secure aggregation: trainers (their updates, their BatchNorm
statistics before a release) and weak devices (their class prototypes) alike.

It answers the SECAGG stages with its `SecureUploads` (device.py) and sends a masked reply once
the neighbours' shares are here: TRAIN_RES for a round, EVAL_RES for a release pool. Nothing here
imports `cryptography` until a device is given keys.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..protocol import MAX_REFUSAL_DETAIL, Envelope, Kind, Reason
from ..session import DeviceSession
from . import stages

if TYPE_CHECKING:
    from .device import SecAggKeys, SecureUploads

log = logging.getLogger(__name__)


class SecureSession(DeviceSession):
    """A DeviceSession with secure-aggregation keys (or None: it says it cannot take part)."""

    def __init__(self, client_id: str, *, secagg_keys: SecAggKeys | None, examples: int, **session: Any):
        super().__init__(client_id, **session)
        self.secure: SecureUploads | None = None
        if secagg_keys is not None:
            from .device import SecureUploads

            self.secure = SecureUploads(client_id, secagg_keys, examples)

    def secure_capability(self) -> dict[str, Any]:
        """The HELLO config entry of a device that speaks secure aggregation (empty without keys)."""
        return {stages.CAPABILITY: stages.VERSION} if self.secure is not None else {}

    def _on_secagg(self, envelope: Envelope) -> None:
        """A secure-aggregation stage: answered with SECAGG_RES (keys, shares, unmasking), or the
        shares addressed to this device, after which a waiting masked reply goes up. A stage that
        contradicts what the device knows or signed (a survivor set other than the one it signed,
        too few neighbours' signatures, withheld shares, a graph seed chosen for it) is refused:
        answered with `refused` = `secagg_inconsistent` and why, which the coordinator counts.
        Another stage it must not answer (a bad signature) is logged and left unanswered. Either
        way the device drops out of the round, and its secrets stay here."""
        if self.secure is None or not self.current(envelope) or self.answered(envelope):
            return
        from .errors import Inconsistent, SecAggError

        try:
            reply = self.secure.on_stage(envelope)
        except Inconsistent as exc:
            log.warning("%s: secure aggregation of round %d: %s; refused", self.client_id, envelope.round, exc)
            reply = {stages.REFUSED: Reason.SECAGG_INCONSISTENT.value, stages.DETAIL: str(exc)[:MAX_REFUSAL_DETAIL]}
        except SecAggError as exc:
            log.warning("%s: secure aggregation of round %d: %s; not answered", self.client_id, envelope.round, exc)
            return
        if reply is not None:
            self.send(Kind.SECAGG_RES, envelope.round, request=envelope,
                      config={stages.STAGE: envelope.config.get(stages.STAGE), **reply})
        self._send_masked()

    def _send_pool_share(self, request: Envelope, arrays: dict[str, Any], metrics: dict[str, float],
                         config: dict[str, Any] | None = None) -> None:
        """This device's share of a release pool (the pool's EVALUATE under secure aggregation) as a
        masked vector in the EVAL_RES, sent once the neighbours' shares are here; a device without
        keys, or whose share must not go up (not finite, implausible counts), logs it and leaves
        the request unanswered (it drops out of the pool)."""
        from .errors import SecAggError

        if self.secure is None:
            log.warning("%s: a release pool asked for under secure aggregation, and this device has no keys",
                        self.client_id)
            return
        try:
            self.secure.pool_share(request, arrays, metrics, config)
        except SecAggError as exc:
            log.warning("%s: %s; not answered", self.client_id, exc)
            return
        self._send_masked()

    def _send_masked(self) -> None:
        """Send the pending masked reply once it can be masked (its neighbours' shares are here)."""
        ready = self.secure.ready() if self.secure is not None else None
        if ready is not None:
            kind = Kind.EVAL_RES if ready.request.kind is Kind.EVALUATE else Kind.TRAIN_RES
            self.send(kind, ready.request.round, request=ready.request, groups=ready.groups, metrics=ready.metrics,
                      config=ready.config)

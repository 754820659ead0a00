"""`Exchange`: one request at a time and its replies, admitted or refused.

A request is broadcast and its replies collected (`RoundCollector`) until the collector says
the request is over; each reply is admitted (its round, kind, request, selection and duplicate
checks) or refused, with a NACK where its sender is registered. A device that refused the
request itself says why (`refused`, `detail`): counted under its reason, not waited for, and a
run whose every device asked refused is stopped (`EveryDeviceRefused`). The refusals of the
round so far are kept for its record. A device that registers again, or asks for the state a
TRAIN changes (FETCH `state`, under a lossy `downlink_codec`), gets the open TRAIN in full on its
own topic (`rounds.downlink`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from edge_sdk.channel import Received
from edge_sdk.downlink import STATE, Announced
from edge_sdk.protocol import REFUSABLE_REQUESTS, Envelope, Kind, ProtocolError, Reason, Refusal, refusal_of

from ..events import DeviceRefused
from ..fleet.outbox import resent
from ..rounds.collector import Outcome, RoundCollector, every_device_refused
from ..rounds.downlink import Downlink
from .context import RunContext

log = logging.getLogger(__name__)

REPLY_KINDS = {Kind.TRAIN: Kind.TRAIN_RES, Kind.EVALUATE: Kind.EVAL_RES, Kind.SECAGG: Kind.SECAGG_RES}
"""The reply kind of each request kind."""


class Exchange:
    """The open request (at most one), its collector, and the round's refusals."""

    def __init__(self, run: RunContext):
        self.run = run
        self.collector: RoundCollector | None = None
        self.refusals: dict[str, str] = {}  # device -> why its answer was rejected, this round
        self.device_refusals: dict[str, Refusal] = {}  # device -> why it refused the request, this round
        self.outstanding: tuple[str, Envelope] | None = None  # the request being collected
        self.full: Envelope | None = None  # the outstanding request with the whole state, for one device
        self.downlink = Downlink(run.config.training.downlink_codec)

    def new_round(self) -> None:
        """Forget the refusals of the round before."""
        self.refusals.clear()
        self.device_refusals.clear()

    def request(self, kind: Kind, envelope: Envelope, collector: RoundCollector,
                on_reply: Callable[[Received], None], *, full: Envelope | None = None) -> Outcome:
        """Broadcast a request and collect the replies until the collector says the round is over.
        `full`: the request with the whole state when it carries a change (the downlink codec),
        what one device is sent again; its arrays are what the outgoing check looks at."""
        run = self.run
        self.full = full if full is not None else envelope
        if kind in (Kind.TRAIN, Kind.EVALUATE):
            run.algorithm.check_outgoing(f"the {kind.value} of round {envelope.round}", self.full.groups)
        self.outstanding = (run.topics.broadcast(kind), envelope)
        self.collector = collector
        run.outbox.send(*self.outstanding)
        try:
            while (outcome := collector.outcome(run.clock())) is Outcome.OPEN:
                run.serve(min(1.0, collector.time_left(run.clock())), on_reply)
            return outcome
        finally:
            self.collector = None
            self.outstanding = None
            self.full = None

    def collector_for(self, round_: int, devices: Iterable[str], *, quorum: int) -> RoundCollector:
        """A collector of `devices`' replies with the round's windows, waiting for `quorum` of them."""
        grace, timeout = self.run.windows()
        chosen = frozenset(devices)
        return RoundCollector(round_, chosen, min_replies=max(1, min(quorum, len(chosen))),
                              deadline=self.run.clock() + timeout, grace=grace)

    def on_hello(self, client_id: str) -> bool:
        """A device registered again: if the open request still waits for it, it gets the request
        again on its own topic (a broadcast published while it was away is lost). True if it did."""
        if self.outstanding is None or self.collector is None or not self.collector.rejoined(client_id):
            return False
        request = self.full if self.full is not None else self.outstanding[1]
        self.run.outbox.send(self.run.topics.down(client_id, request.kind), resent(request))
        return True

    def serve_state(self, fetch: Envelope) -> None:
        """A device asks for the state the open TRAIN changes (FETCH `state` = its version,
        `in_reply_to` = its msg_id): it gets that TRAIN in full on its own topic; any other
        version or request is refused as `stale`."""
        run, request = self.run, self.outstanding[1] if self.outstanding else None
        announced = Announced.of(request.config) if request is not None and request.kind is Kind.TRAIN else None
        wanted = fetch.config.get(STATE)
        if fetch.run_id != run.run_id:
            run.outbox.reject(fetch, Reason.WRONG_RUN, f"FETCH from {fetch.sender} for run {fetch.run_id!r}")
        elif fetch.sender not in run.registry.devices:
            run.outbox.reject(fetch, Reason.UNKNOWN_DEVICE, f"FETCH from {fetch.sender}, never registered")
        elif (request is None or announced is None or self.full is None or type(wanted) is not int
              or wanted != announced.version or fetch.config.get("in_reply_to") != request.msg_id):
            run.outbox.reject(fetch, Reason.STALE, f"FETCH of state {str(wanted)[:20]} from {fetch.sender}: not the "
                                                   "open TRAIN's")
        elif fetch.sender not in request.config.get("selected", ()):
            run.outbox.reject(fetch, Reason.NOT_SELECTED, f"FETCH of state {wanted} from {fetch.sender}")
        else:
            run.outbox.send(run.topics.down(fetch.sender, Kind.TRAIN), resent(self.full))

    def on_offline(self, client_id: str) -> None:
        if self.collector is not None:
            self.collector.mark_offline(client_id, self.run.clock())

    def send_again(self) -> None:
        """After a broker reconnection: publish the open request again."""
        if self.outstanding is not None:
            topic, request = self.outstanding
            self.run.outbox.send(topic, resent(request))

    def admit(self, received: Received, kind: Kind, round_: int, collector: RoundCollector) -> bool:
        """Round, kind, selection and duplicate checks common to every reply."""
        envelope = received.envelope
        request = self.outstanding[1] if self.outstanding else None
        if (envelope.kind is not kind or envelope.round != round_ or request is None
                or envelope.config.get("in_reply_to") != request.msg_id):
            self.reject_reply(envelope, Reason.STALE, f"{envelope.kind.value} from {envelope.sender} for round "
                                                      f"{envelope.round} is not a reply to the open request")
            return False
        reason = collector.check(envelope.sender, envelope.msg_id)
        if reason is Reason.DUPLICATE:
            self.run.channel.count_duplicate()
            return False
        if reason is not None:
            self.run.outbox.reject(envelope, reason, f"{envelope.kind.value} from {envelope.sender} in round {round_}")
            return False
        return not self.device_refused(envelope, collector)

    def device_refused(self, envelope: Envelope, collector: RoundCollector | None) -> bool:
        """A reply that says its device refused the request it answers (`refused`, `detail`):
        that device's answer, counted and logged under its reason (and, with the open request's
        `collector`, not waited for); True if it was one. A malformed refusal is refused as such."""
        if envelope.kind not in REFUSABLE_REQUESTS.values():  # a SECAGG_RES says its refusal its own way (§19)
            return False
        try:
            refusal = refusal_of(envelope)
        except ProtocolError as err:
            detail = f"{envelope.kind.value} from {envelope.sender}: {err.detail}"
            if collector is not None:
                self.refuse(envelope, collector, err.reason, detail)
            else:
                self.refusals[envelope.sender] = err.reason.value
                self.run.outbox.reject(envelope, err.reason, detail)
            return True
        if refusal is None:
            return False
        log.warning("%s refused the %s of round %d (%s): %s", envelope.sender,
                    "train" if envelope.kind is Kind.TRAIN_RES else "evaluate", envelope.round, refusal.reason.value,
                    refusal.detail)
        if collector is not None:
            collector.refuse(envelope.sender, envelope.msg_id)
        self.refusals[envelope.sender] = refusal.reason.value
        self.device_refusals[envelope.sender] = refusal
        self.run.events.emit(DeviceRefused(envelope.round, envelope.sender, refusal.reason.value, refusal.detail))
        return True

    def stop_if_every_device_refused(self, what: str, round_: int, asked: Iterable[str],
                                     answered: Iterable[str]) -> None:
        """Stop the run (`EveryDeviceRefused`) when every device asked refused the request itself
        and none answered it: the next round would send the same and be refused the same."""
        stop = every_device_refused(what, round_, asked, answered, self.device_refusals)
        if stop is not None:
            raise stop

    def refuse(self, envelope: Envelope, collector: RoundCollector, reason: Reason, detail: str) -> None:
        """Reject a device's answer to the open request; it sends no other, so it is not waited for."""
        self.run.outbox.reject(envelope, reason, detail)
        collector.refuse(envelope.sender, envelope.msg_id)
        self.refusals[envelope.sender] = reason.value

    def reject_reply(self, envelope: Envelope, reason: Reason, detail: str) -> None:
        """Refuse a TRAIN_RES or EVAL_RES that fails the reply check. If it answers the open
        request (`answers_open_request`) and its sender is one the request still waits for, it
        is that device's answer, refused: the request stops waiting for it."""
        collector = self.collector
        if (collector is not None and self.answers_open_request(envelope)
                and collector.check(envelope.sender, envelope.msg_id) is None):
            self.refuse(envelope, collector, reason, detail)
        else:
            self.run.outbox.reject(envelope, reason, detail)

    def answers_open_request(self, envelope: Envelope) -> bool:
        """A reply is meant for the open request when it names it (`in_reply_to` = its msg_id),
        or names none (no str `in_reply_to`) while its kind and round are those of the request's
        replies; a reply naming another request is not."""
        if self.outstanding is None:
            return False
        request = self.outstanding[1]
        named = envelope.config.get("in_reply_to")
        if isinstance(named, str):
            return named == request.msg_id
        return envelope.kind is REPLY_KINDS.get(request.kind) and envelope.round == request.round

"""The protocol state machine every device shares, trainer or weak: no torch here.

A session connects with its Last Will set, subscribes to the broadcast and its own downstream
topics, and registers with HELLO when a coordinator announces itself: the retained STATUS that
arrives right after subscribing, and each STATUS with a new coordinator incarnation or connection
epoch. It says HELLO again after a reconnection, and every `hello_interval` while no coordinator
has answered (a broker that lost the retained STATUS). A device never says HELLO both on
connecting and on the STATUS of the same coordinator: the coordinator would count one
registration twice. A STATUS `finished` of a run the device is not in means nobody is there to
answer: the device says no HELLO until a coordinator announces itself with another STATUS.
While it has nobody to talk to it says so (INFO, on the `edge_sdk.session.waiting` logger,
which `lifecycle.run_until_done` shows without -v): once, and again every `notice_interval`.
It joins the run a WELCOME names,
and answers requests. A repeated request (same message id) gets the cached reply, message id
included, so work is neither redone nor applied twice. A NACK (the coordinator refused one of
its messages) is logged as one warning. Subclasses say what the device is (`hello`), how it joins
(`join`) and which downstream kinds it handles (`handlers`).

Under sharded aggregation the WELCOME names the device's shard, and its updates (TRAIN_RES)
go to that shard's aggregator (`Topics.shard`) instead of the coordinator.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from collections.abc import Callable
from typing import Any

from . import wire
from .channel import Channel, Received
from .chunks import DEFAULT_UPLOAD_CHUNK_SIZE
from .privacy.upstream import PRIVACY
from .protocol import (MAX_REFUSAL_DETAIL, NACK_FIELDS, REFUSAL_DETAIL, REFUSABLE_REQUESTS, REFUSED, REPORTED_REFUSALS,
                       SHARD_KINDS, Envelope, Kind, ProtocolError, Reason, Topics, check_client_id)
from .secagg.stages import SECURE as SECURE_RUN
from .signing import Signer, Verifier
from .transport import MqttSettings, MqttTransport

log = logging.getLogger(__name__)
waiting_log = logging.getLogger(f"{__name__}.waiting")
"""Where a device with nobody to talk to says so: a user needs to see it without -v."""

MAX_CACHED_REPLIES = 16
RECEIVE_WAIT = 0.5
"""Seconds the session waits for a message before its periodic duties (HELLO, notices, silence)."""
SUBACK_POLL = 0.01
"""Seconds between two looks at the subscriptions while a HELLO waits for the broker to grant them:
the SUBACK comes within milliseconds, and a device's registration should not wait `RECEIVE_WAIT`."""


class RegistrationRefused(RuntimeError):
    """The coordinator (or the device's own check of the run's model) refused this device: it
    cannot take part in the run as it is; the message says why."""


class DeviceSession:
    """One device's connection to a federation. `run()` blocks until the run finishes or `stop`."""

    def __init__(
        self,
        client_id: str,
        *,
        broker: MqttSettings | str = "mqtt://127.0.0.1:1883",
        federation: str = "default",
        state_dir: str | Path = "edgepfl-state",
        chunk_size: int = DEFAULT_UPLOAD_CHUNK_SIZE,
        exit_on_finish: bool = True,
        hello_interval: float = 15.0,
        notice_interval: float = 300.0,
        silence_interval: float = 60.0,
        transport=None,
        max_pending_blobs: int = 64,
        verifier: Verifier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.client_id = check_client_id(client_id)
        self.topics = Topics(federation)
        self.state_dir = Path(state_dir)
        self.exit_on_finish = exit_on_finish
        self.hello_interval = hello_interval
        self.notice_interval = notice_interval
        self.silence_interval = silence_interval
        self.clock = clock
        settings = MqttSettings(url=broker) if isinstance(broker, str) else broker
        signer = Signer(settings.signing_key) if settings.signing_key is not None else None
        will_pieces = wire.encode_pieces(Envelope(Kind.OFFLINE, client_id))
        will = (self.topics.up(client_id, Kind.OFFLINE),
                b"".join(signer.seal(will_pieces) if signer is not None else will_pieces))
        if transport is None:
            transport = MqttTransport(f"{federation}.{client_id}", settings, will=will)
        # repeated requests reach `answered`, which sends the cached reply (a Last Will is the same
        # bytes every time, and marking a device offline is idempotent)
        self.channel = Channel(transport, self.topics, chunk_size=chunk_size, max_pending_blobs=max_pending_blobs,
                               repeatable=frozenset({Kind.TRAIN, Kind.EVALUATE, Kind.SECAGG}), signer=signer,
                               verifier=verifier)
        self.run_id: str | None = None
        self.joined = False
        self._announcement: tuple | None = None
        self._hello_due = False  # a STATUS asked for a HELLO before the broker granted our subscriptions
        self._last_hello = float("-inf")
        self._connections_at_hello = 0
        self._finished = False
        self._status: Envelope | None = None  # the latest STATUS seen, of any run
        self._idle = False  # that STATUS said its run finished, and this device is in no live run: no HELLO
        self._next_notice = float("inf")  # when to say next that this device is waiting for a coordinator
        self._heard = float("-inf")  # when the broker last delivered anything to this device
        self.upload_shard: int | None = None
        """The shard whose aggregator reads this device's updates (WELCOME `shard`); None: the coordinator."""
        self._replies: OrderedDict[str, Envelope] = OrderedDict()  # request msg_id -> our reply

    # -- what subclasses provide -----------------------------------------------------------
    def hello(self) -> tuple[dict[str, float], dict[str, Any]]:
        """(metrics with num_examples, config with device_type and capabilities) for HELLO."""
        raise NotImplementedError

    def join(self, welcome: Envelope) -> None:
        """Set up for the run WELCOME describes (called once per run)."""
        raise NotImplementedError

    def handlers(self) -> dict[Kind, Callable[[Envelope], None]]:
        """Handlers of the downstream kinds beyond STATUS and WELCOME."""
        return {}

    def subscriptions(self) -> list[str]:
        """The topic filters this session reads: the broadcasts and its own downstream topics."""
        return self.topics.device_subscriptions(self.client_id)

    def tick(self) -> None:
        """Called after every message and every idle half second of `run` (nothing by default)."""

    @property
    def run_private(self) -> bool:
        """The latest STATUS announced a run under DP: HELLO then says nothing of the device's
        data (no example or label counts), which no DP mechanism would cover."""
        return self._status is not None and bool(self._status.config.get(PRIVACY))

    @property
    def run_secure(self) -> bool:
        """The latest STATUS announced a run under secure aggregation: HELLO then gives only a bound
        on the device's examples, and its replies no count (privacy/disclosure.py)."""
        return self._status is not None and self._status.config.get(SECURE_RUN) is True

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """True once the coordinator announced that the joined run finished."""
        return self._finished

    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        self.channel.transport.connect()
        handlers = {Kind.STATUS: self._on_status, Kind.WELCOME: self._on_welcome, Kind.NACK: self._on_nack,
                    **self.handlers()}
        try:
            for topic_filter in self.subscriptions():
                self.channel.transport.subscribe(topic_filter)
            # the first HELLO answers the coordinator's STATUS; without one, `hello_interval` from now
            self._last_hello = self.clock()
            self._next_notice = min(self._next_notice, self._last_hello + self.hello_interval)
            self._connections_at_hello = getattr(self.channel.transport, "connections", 1)
            self._heard = self._last_hello
            while not stop.is_set() and not self._finished:
                received = self.channel.receive(timeout=SUBACK_POLL if self._hello_due else RECEIVE_WAIT)
                if received is not None:
                    self._dispatch(received, handlers)
                    self._heard = self.clock()  # after the work it asked for: a long training is no silence
                elif self._should_hello():
                    self._hello()
                self._subscribe_again_after_silence()
                self._notice_if_waiting()
                self.tick()
        finally:
            self.channel.transport.close()

    def _dispatch(self, received: Received, handlers: dict[Kind, Callable[[Envelope], None]]) -> None:
        envelope = received.envelope
        handler = handlers.get(envelope.kind)
        if handler is None:
            return
        try:
            handler(envelope)
        except ProtocolError as err:
            self.channel.reject(err.reason, f"{envelope.kind.value} round {envelope.round}: {err.detail}")
            self._refuse_upward(envelope, err.reason, err.detail)
        except (ValueError, KeyError, TypeError) as exc:  # e.g. a WELCOME naming an unknown algorithm
            self.channel.reject(Reason.MALFORMED, f"{envelope.kind.value}: {type(exc).__name__}: {exc}")
            self._refuse_upward(envelope, Reason.MALFORMED, f"{type(exc).__name__}: {exc}")

    def _refuse_upward(self, request: Envelope, reason: Reason, detail: str) -> None:
        """Tell the coordinator this device cannot take `request` (a TRAIN or EVALUATE of its run
        that selects it, refused for a reason in `REPORTED_REFUSALS`): a reply of the request's
        reply kind with only the reason and the detail, so the round stops waiting for it. Other
        refusals stay silent: a request of another run, or not for this device, is none of its business."""
        reply_kind = REFUSABLE_REQUESTS.get(request.kind)
        selected = request.config.get("selected")
        if (reply_kind is None or reason not in REPORTED_REFUSALS or not self.joined or request.run_id != self.run_id
                or not isinstance(selected, list) or self.client_id not in selected
                or request.msg_id in self._replies):
            return
        self.send(reply_kind, request.round, request=request, topic=self.topics.up(self.client_id, reply_kind),
                  config={REFUSED: reason.value, REFUSAL_DETAIL: detail[:MAX_REFUSAL_DETAIL]})

    def handle(self, envelope: Envelope) -> None:
        """Act on one downstream envelope as `run` does on receiving it (STATUS, WELCOME, then
        `handlers()`; other kinds are ignored), raising what its handler raises. For callers that
        hand a device its envelopes themselves, without a broker (the in-process baseline of
        benchmarks/overhead.py); replies still go out through `send`."""
        handler = {Kind.STATUS: self._on_status, Kind.WELCOME: self._on_welcome, **self.handlers()}.get(envelope.kind)
        if handler is not None:
            handler(envelope)

    # -- registration ----------------------------------------------------------------------
    def _subscribed(self) -> bool:
        """The broker granted every subscription: a WELCOME, and the TRAIN after it, reach us. A
        clustered broker (NATS) can refuse a subscription under load; the transport retries it."""
        return getattr(self.channel.transport, "subscriptions_active", lambda: True)()

    def _should_hello(self) -> bool:
        """Register (again) only once the broker granted our subscriptions (the WELCOME, and the
        round's TRAIN, must find us listening): after a reconnection (the coordinator saw our Last
        Will), after a STATUS that arrived too early, or while no coordinator has answered yet.
        Never while the latest STATUS says its run finished: nobody would answer."""
        if not self._subscribed() or self._idle:
            return False
        reconnected = getattr(self.channel.transport, "connections", 1) != self._connections_at_hello
        unanswered = not self.joined and self.clock() - self._last_hello > self.hello_interval
        return reconnected or unanswered or self._hello_due

    def _subscribe_again_after_silence(self) -> None:
        """After `silence_interval` with nothing delivered, make every subscription again: the
        broker replaces each and re-sends its retained messages (MQTT 3.1.1 and 5, §3.8.4), the
        STATUS among them. A broker that stopped delivering to a subscription without closing the
        connection (a NATS JetStream consumer stalled by a leader election), and a final STATUS
        lost with it, then cost a minute, not the device's wait for a run that ended."""
        if self.clock() - self._heard < self.silence_interval:
            return
        self._heard = self.clock()
        log.info("%s: nothing received for %g s; subscribing again (the broker re-sends the retained STATUS)",
                 self.client_id, self.silence_interval)
        self._subscribe_again()

    def resync(self, why: str) -> None:
        """Subscribe again and, once the broker granted every subscription, say HELLO again: the
        coordinator then repeats what it still waits for this session to answer. For a session
        that sees evidence of a lost message (`why`): a broker that stopped delivering to one
        subscription without closing the connection loses what was published meanwhile."""
        log.warning("%s: %s; subscribing and registering again", self.client_id, why)
        self._heard = self.clock()
        self._subscribe_again()
        self._hello_due = True

    def _subscribe_again(self) -> None:
        for topic_filter in self.subscriptions():
            self.channel.transport.subscribe(topic_filter)

    def _hello(self) -> None:
        self._hello_due = self._idle = False
        self._last_hello = self.clock()
        self._connections_at_hello = getattr(self.channel.transport, "connections", 1)
        metrics, config = self.hello()
        self.send(Kind.HELLO, metrics=metrics, config=config)
        log.info("%s: HELLO sent to federation %s", self.client_id, self.topics.federation)

    def _on_status(self, status: Envelope) -> None:
        # a new coordinator process, or the coordinator back from a broker outage: register again
        announcement = (status.config.get("incarnation"), status.config.get("epoch"))
        if status.config.get("state") == "finished":
            own = self.joined and status.run_id == self.run_id
            if own and self.exit_on_finish:
                log.info("%s: run %s finished", self.client_id, self.run_id)
                self._finished = True
            elif (own or not self.joined) and not self._idle:  # nobody left to answer a HELLO
                self._status, self._idle, self._next_notice = status, True, self.clock()
            return
        self._status = status
        if announcement != self._announcement or self._idle:
            self._announcement, self._idle = announcement, False
            if self._subscribed():
                self._hello()
            else:
                self._hello_due = True

    def _notice_if_waiting(self) -> None:
        """Say (INFO, shown without -v) that this device waits for a coordinator, and what it
        saw last: once it has waited `hello_interval` or seen a finished run, then every
        `notice_interval`, for as long as it is in no live run."""
        if self.joined and not self._idle:
            return
        now = self.clock()
        if now < self._next_notice:
            return
        self._next_notice = now + self.notice_interval
        waiting_log.info("%s: waiting for a coordinator of federation %s; %s", self.client_id,
                         self.topics.federation, self._last_seen())

    def _last_seen(self) -> str:
        status = self._status
        if status is None:
            return f"no coordinator status seen yet (HELLO every {self.hello_interval:g} s)"
        state = status.config.get("state")
        if state == "finished":
            return (f"last seen: run {status.run_id} finished after {status.round} rounds (a new coordinator's "
                    "status will be answered)")
        return f"last seen: run {status.run_id} {state}, no WELCOME yet (HELLO every {self.hello_interval:g} s)"

    def _on_nack(self, nack: Envelope) -> None:
        """The coordinator refused one of this device's messages: say which, and why."""
        in_reply_to, kind, reason = (nack.config.get(name) for name in NACK_FIELDS)
        if not all(isinstance(value, str) for value in (in_reply_to, kind, reason)):
            raise ProtocolError(Reason.MALFORMED, f"a NACK carries {', '.join(NACK_FIELDS)} as text")
        log.warning("%s: the coordinator refused %s %s: %s (reason codes: docs/PROTOCOL.md section 11)",
                    self.client_id, kind, in_reply_to, reason)

    def _on_welcome(self, welcome: Envelope) -> None:
        refusal = welcome.config.get("refused")
        if refusal is not None:
            raise RegistrationRefused(f"{self.client_id}: the coordinator refused the registration: {refusal}")
        shard = welcome.config.get("shard")
        self.upload_shard = shard if isinstance(shard, int) and not isinstance(shard, bool) and shard >= 0 else None
        self._idle = False
        if self.joined and welcome.run_id == self.run_id:
            return  # a repeated registration within the same run
        self.join(welcome)
        self.run_id, self.joined = welcome.run_id, True
        log.info("%s: joined run %s", self.client_id, self.run_id)

    # -- requests and replies --------------------------------------------------------------
    def send(self, kind: Kind, round_: int = 0, *, request: Envelope | None = None, topic: str | None = None,
             **fields) -> None:
        """Publish an envelope (on `topic_for(kind)` unless `topic` is given). A reply to
        `request` names it (`in_reply_to`) and is kept, so a repeat of the request gets the same reply."""
        if request is not None:
            fields["config"] = {**fields.get("config", {}), "in_reply_to": request.msg_id}
        envelope = Envelope(kind, self.client_id, run_id=self.run_id or "", round=round_, **fields)
        self.channel.send(topic or self.topic_for(kind), envelope)
        if request is not None:
            self._replies[request.msg_id] = envelope
            while len(self._replies) > MAX_CACHED_REPLIES:
                self._replies.popitem(last=False)

    def current(self, envelope: Envelope) -> bool:
        """True if a request belongs to the joined run and selects this device (re-registers if
        it belongs to a run this device has not joined)."""
        if not self.joined or envelope.run_id != self.run_id:
            self._hello()
            return False
        selected = envelope.config.get("selected")
        return isinstance(selected, list) and self.client_id in selected

    def answered(self, request: Envelope) -> bool:
        """A request repeated (QoS 1 redelivery, or re-published after a broker outage) gets the
        same reply again, message id included; True if it was one."""
        reply = self._replies.get(request.msg_id)
        if reply is None:
            return False
        refusal = REFUSED in reply.config  # a refusal goes to the coordinator, in a sharded run too
        self.channel.send(self.topics.up(self.client_id, reply.kind) if refusal else self.topic_for(reply.kind), reply)
        return True

    def topic_for(self, kind: Kind) -> str:
        """Where this device sends `kind`: its update to its shard's aggregator when it has a shard,
        everything else to the coordinator."""
        if kind in SHARD_KINDS and self.upload_shard is not None:
            return self.topics.shard(self.upload_shard, self.client_id, kind)
        return self.topics.up(self.client_id, kind)

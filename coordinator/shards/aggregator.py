"""A shard aggregator (`edgepfl aggregator --shard k/K`): sums its shard's updates for the coordinator.

It registers like a device (HELLO with device_type "aggregator", id `aggregator-<k>`); the
WELCOME gives it what the coordinator checks updates with (the algorithm and its
hyperparameters, model, task, limits, upload codec, aggregation settings). Each round the
coordinator sends it a ROSTER (its shard's selected devices and their registered examples)
before the TRAIN broadcast, whose arrays are the reference. Updates arrive on the shard's
topic (`Topics.shard_updates`); each is checked exactly as the coordinator checks one
(`checked_update`) and folded with the algorithm's own `accumulate` into a running sum
(`ServerAlgorithm.begin_partial`). An update that answers the open round (it names the
round's TRAIN in `in_reply_to`, or names none while its round is the open one) from a device of
the roster is that device's answer: folded, or refused when it fails a check (naming no request
included), as the coordinator refuses one unsharded. NOTEs (batched every `note_interval`
seconds) tell the coordinator which updates were folded or refused, a refused one by its
msg_id, so its quorum and deadline work as unsharded and the device is NACKed. The PARTIAL
(the sums, their total weight, the devices folded) goes up once: when every device of the
roster answered, or when the coordinator CLOSEs the round.

An update still waiting `resync_after` seconds for its round's ROSTER or TRAIN means one of them
was lost (a clustered broker can stop delivering to one subscription for a while without closing
the connection): the aggregator subscribes and says HELLO again, and the coordinator repeats the
open round's ROSTER and TRAIN to it, and the TRAIN to each device of the shard it has not heard
from, which sends its kept reply again.

It holds one model-sized sum and the reference, never an update longer than it takes to fold
it, and never a device's personal state (only shared arrays travel on the shard topic). Under
secure aggregation the ROSTER gives the length of the round's masked vectors: each update is
one, checked for its form and added mod 2^32, and the PARTIAL is their sum, still masked; the
coordinator unmasks it with the shard's survivors' shares, which the aggregator never sees. With a
`verifier` (the fleet's signing keys) every update must carry its device's signature, checked
before it is decoded, as the coordinator checks them unsharded.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.codecs import DEFAULT_TOPK_FRACTION, UploadCodec
from edge_sdk.config import ConfigError
from edge_sdk.data.task import TaskSpec
from edge_sdk.protocol import ArrayGroup, Envelope, Kind, ProtocolError, Reason, aggregator_id
from edge_sdk.secagg import stages
from edge_sdk.session import DeviceSession
from edge_sdk.signing import Verifier
from edge_sdk.transport import MqttSettings

from .. import algorithms
from ..aggregation.robust import AggregationSettings
from ..aggregation.validation import UpdateLimits, checked_update
from ..algorithms.base import ServerAlgorithm, ServerContext
from .sharding import AGGREGATOR, masked_partial_fields, partial_envelope_fields

log = logging.getLogger(__name__)

MAX_NOTE_ENTRIES = 128
"""Devices named in one NOTE (it stays within the control-message size limit)."""
MAX_EARLY_UPDATES = 256
"""Updates kept that are handed out before their round's ROSTER or TRAIN (the receive queue
takes senders in turn, so a device's update can overtake the coordinator's messages); they are
checked once both are here. Beyond this many, an early update is dropped (`over_budget`)."""
KEPT_REQUESTS = 4
"""TRAIN broadcasts and ROSTERs kept while waiting for their counterpart."""
RESYNC_AFTER = 20.0
"""Seconds an early update may wait for its round's ROSTER and TRAIN before the aggregator
takes them for lost and registers again, so that the coordinator repeats them."""


def parse_shard(text: str) -> tuple[int, int]:
    """`k/K` -> (k, K), with 0 <= k < K; ValueError naming the flag otherwise."""
    try:
        shard, shards = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be k/K (e.g. 0/2), got {text!r}") from None
    if not 0 <= shard < shards:
        raise ValueError(f"--shard k/K needs 0 <= k < K, got {text!r}")
    return shard, shards


@dataclass
class OpenRound:
    """The round being summed: its request, reference, roster and who answered."""

    request_id: str
    round: int
    sent: dict[str, ArrayGroup]
    roster: dict[str, int]
    folded: list[str] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)
    """Devices whose latest answer was refused (one folded later leaves it)."""
    partial_sent: bool = False
    masked_sum: np.ndarray | None = None
    """Under secure aggregation: the sum mod 2^32 of the masked vectors folded (uint32)."""

    @property
    def complete(self) -> bool:
        return len(self.folded) + len(self.refused) >= len(self.roster)

    def answered_by(self, update: Envelope) -> bool:
        """True if `update` is meant for this round's request: it names it (`in_reply_to`), or
        names none (no str `in_reply_to`) while its round is this one; one naming another
        request is not."""
        named = update.config.get("in_reply_to")
        return named == self.request_id if isinstance(named, str) else update.round == self.round


class ShardAggregator(DeviceSession):
    """Shard `shard` of `shards`: `run()` until the coordinator's run finishes (or `stop`)."""

    def __init__(self, shard: int, shards: int, *, broker: MqttSettings | str = "mqtt://127.0.0.1:1883",
                 federation: str = "default", note_interval: float = 0.2, transport=None,
                 max_pending_blobs: int = 4096, verifier: Verifier | None = None,
                 clock: Callable[[], float] = time.monotonic, resync_after: float = RESYNC_AFTER):
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be in [0, {shards}), got {shard}")
        super().__init__(aggregator_id(shard), broker=broker, federation=federation, transport=transport,
                         max_pending_blobs=max_pending_blobs, verifier=verifier)
        self.shard, self.shards = shard, shards
        self.note_interval = note_interval
        self.clock = clock
        self.resync_after = resync_after
        self.algorithm: ServerAlgorithm | None = None
        self.limits = UpdateLimits(1, 0.0)
        self.codec = UploadCodec()
        self.trains: OrderedDict[str, Envelope] = OrderedDict()
        self.rosters: OrderedDict[str, Envelope] = OrderedDict()
        self.open: OpenRound | None = None
        self.early: list[Envelope] = []
        self._early_since: float | None = None  # when the oldest update of `early` came
        self._last_resync = float("-inf")
        self.partials_sent = 0
        self._notes: tuple[list[str], list[list[str]]] = ([], [])
        self._last_note = float("-inf")

    # -- the session's hooks ---------------------------------------------------------------
    def hello(self) -> tuple[dict[str, float], dict[str, Any]]:
        return {}, {"device_type": AGGREGATOR, "shard": self.shard, "shards": self.shards}

    def subscriptions(self) -> list[str]:
        """Its own downstream topics and the broadcasts, and its shard's updates (subscribed
        before it registers, so before any device of the shard can send one)."""
        return [*super().subscriptions(), self.topics.shard_updates(self.shard)]

    def handlers(self) -> dict[Kind, Callable[[Envelope], None]]:
        return {Kind.TRAIN: self._on_train, Kind.ROSTER: self._on_roster, Kind.CLOSE: self._on_close,
                Kind.TRAIN_RES: self._on_update}

    def join(self, welcome: Envelope) -> None:
        """Build the algorithm's server side, as the coordinator has it, from the WELCOME."""
        described = welcome.config.get("aggregation")
        if not isinstance(described, dict):
            raise ConfigError(f"{self.client_id}: the WELCOME carries no aggregation settings (is `shards` set?)")
        algorithm_id = welcome.config["algorithm"]
        hyper = algorithms.hyperparameters(algorithm_id, welcome.config.get("hyper", {}))
        context = ServerContext(described["model"], TaskSpec.from_plain(described["task"]), int(described["seed"]),
                                int(described["rounds"]), int(described["clients"]),
                                AggregationSettings(**described["rule"]))
        self.algorithm = algorithms.load(algorithm_id)(hyper, context)
        self.limits = UpdateLimits(int(described["max_examples"]), float(described["max_update_norm"]))
        self.codec = UploadCodec(str(described["upload_codec"]),
                                 float(described.get("topk_fraction", DEFAULT_TOPK_FRACTION)))
        log.info("%s: joined run %s (%s), summing shard %d of %d", self.client_id, welcome.run_id, algorithm_id,
                 self.shard, self.shards)

    def tick(self) -> None:
        now = self.clock()
        if self._notes[0] or self._notes[1]:
            if now - self._last_note >= self.note_interval:
                self._send_note()
        if (self._early_since is not None and now - self._early_since >= self.resync_after
                and now - self._last_resync >= self.resync_after):
            self._last_resync = now
            rounds = sorted({update.round for update in self.early})
            self.resync(f"{len(self.early)} updates of round {', '.join(map(str, rounds))} waited "
                        f"{now - self._early_since:.0f} s for their round's ROSTER and TRAIN")

    # -- the round -------------------------------------------------------------------------
    def _ours(self, envelope: Envelope) -> bool:
        return self.joined and envelope.run_id == self.run_id and self.algorithm is not None

    def _on_train(self, train: Envelope) -> None:
        repeated = train.msg_id in self.trains or (self.open is not None and self.open.request_id == train.msg_id)
        if self._ours(train) and not repeated:
            _keep(self.trains, train.msg_id, train)
            self._try_open(train.msg_id)

    def _on_roster(self, roster: Envelope) -> None:
        request = roster.config.get("request")
        devices = roster.config.get("devices")
        if not isinstance(request, str) or not isinstance(devices, dict):
            raise ProtocolError(Reason.MALFORMED, "a ROSTER names its request and its devices")
        if self._ours(roster) and request not in self.rosters:
            _keep(self.rosters, request, roster)
            self._try_open(request)

    def _try_open(self, request: str) -> None:
        """Start summing the round of `request` once both its TRAIN and its ROSTER are here."""
        if request not in self.trains or request not in self.rosters:
            return
        train, roster = self.trains.pop(request), self.rosters.pop(request)
        if self.open is not None and not self.open.partial_sent:
            log.warning("%s: round %d superseded by round %d before its partial was asked for", self.client_id,
                        self.open.round, train.round)
        devices = {str(c): int(n) for c, n in roster.config["devices"].items()}
        round_ = self.open = OpenRound(request, train.round, train.groups, devices)
        secure = roster.config.get(stages.SECURE)
        if isinstance(secure, dict) and isinstance(secure.get(stages.LENGTH), int) and secure[stages.LENGTH] > 0:
            round_.masked_sum = np.zeros(secure[stages.LENGTH], dtype=np.uint32)
        else:
            self._algorithm().begin_partial(train.round, train.groups)
        early, self.early = self.early, []
        for update in early:
            if round_.answered_by(update):
                self._answer(round_, update)
            elif update.round > train.round:
                self.early.append(update)
            else:
                self.channel.reject(Reason.STALE, f"update from {update.sender} for round {update.round}, kept until "
                                                  f"round {train.round} opened, is not a reply to it")
        self._early_since = self.clock() if self.early else None
        self._finish_if_complete()

    def _on_update(self, update: Envelope) -> None:
        if self.open is not None and self.open.answered_by(update):
            self._answer(self.open, update)
            self._finish_if_complete()
        elif self.joined and update.run_id != self.run_id:
            raise ProtocolError(Reason.WRONG_RUN, f"update from {update.sender} for run {update.run_id!r}")
        elif self.open is None or update.round > self.open.round:
            if len(self.early) >= MAX_EARLY_UPDATES:
                raise ProtocolError(Reason.OVER_BUDGET, f"update from {update.sender}: too many before its ROSTER")
            self.early.append(update)
            if self._early_since is None:
                self._early_since = self.clock()
        else:
            raise ProtocolError(Reason.STALE, f"update from {update.sender} for round {update.round} is not a reply "
                                              "to the open round")

    def _algorithm(self) -> ServerAlgorithm:
        """The algorithm built at `join`; a round only opens after it (`_ours`)."""
        if self.algorithm is None:
            raise RuntimeError(f"{self.client_id}: a round opened before the WELCOME")
        return self.algorithm

    def _answer(self, round_: OpenRound, update: Envelope) -> None:
        """`update` answers the open round: if its sender's answer is still awaited (a device of
        the roster, none of its updates folded, the partial not sent), it is refused when it
        fails the reply check (run, round, `in_reply_to` naming the round's TRAIN), else checked
        and folded; otherwise it is rejected, counted."""
        sender = update.sender
        if sender not in round_.roster:
            self.channel.reject(Reason.NOT_SELECTED, f"update from {sender} in round {round_.round}")
        elif sender in round_.folded:
            self.channel.reject(Reason.CONFLICTING_REPLY, f"a second update from {sender} in round {round_.round}")
        elif round_.partial_sent:
            self.channel.reject(Reason.STALE, f"update from {sender} after the round {round_.round} partial left")
        elif update.run_id != self.run_id:
            self._refuse(round_, update, Reason.WRONG_RUN, f"run {update.run_id!r}")
        elif update.round != round_.round or update.config.get("in_reply_to") != round_.request_id:
            self._refuse(round_, update, Reason.STALE, f"round {update.round} naming request "
                                                       f"{str(update.config.get('in_reply_to'))[:40]!r}, not the "
                                                       f"TRAIN of round {round_.round} it answers")
        else:
            self._fold(round_, update)

    def _fold(self, round_: OpenRound, update: Envelope) -> None:
        """Check one update as the coordinator does, then fold it into the shard's sum (a
        device's corrected update, after a refused one, too). Under secure aggregation the
        update is a masked vector: checked for its form only, and added to the masked sum."""
        sender = update.sender
        try:
            if round_.masked_sum is not None:
                masked = stages.masked_vector(update.groups, f"update from {sender}")
                if masked.shape != round_.masked_sum.shape:
                    raise ProtocolError(Reason.SECAGG_INVALID, f"masked vector of length {masked.size}, the round's "
                                                               f"is {round_.masked_sum.size}")
                round_.masked_sum += masked
            else:
                groups, weight = checked_update(self._algorithm(), round_.round, update, round_.sent,
                                                round_.roster[sender], self.limits, self.codec)
                self._algorithm().accumulate(sender, groups, update.metrics, weight)
        except ProtocolError as err:
            self._refuse(round_, update, err.reason, err.detail)
            return
        round_.refused.discard(sender)
        round_.folded.append(sender)
        self._notes[0].append(sender)
        self._note_if_full()

    def _refuse(self, round_: OpenRound, update: Envelope, reason: Reason, detail: str) -> None:
        """`update` is its sender's answer, refused: counted, and noted with its msg_id so that
        the coordinator stops waiting for the device and NACKs it."""
        self.channel.reject(reason, f"update from {update.sender}: {detail}")
        round_.refused.add(update.sender)
        self._notes[1].append([update.sender, reason.value, detail[:200], update.msg_id])
        self._note_if_full()

    def _note_if_full(self) -> None:
        if len(self._notes[0]) + len(self._notes[1]) >= MAX_NOTE_ENTRIES:
            self._send_note()

    def _finish_if_complete(self) -> None:
        if self.open is not None and self.open.complete and not self.open.partial_sent:
            self._send_partial(self.open)

    def _on_close(self, close: Envelope) -> None:
        if self.open is not None and close.config.get("request") == self.open.request_id and not self.open.partial_sent:
            self._send_partial(self.open)

    # -- what goes up ----------------------------------------------------------------------
    def _send_note(self) -> None:
        accepted, refused = self._notes
        self._notes, self._last_note = ([], []), self.clock()
        if self.open is None or not (accepted or refused):
            return
        self.send(Kind.NOTE, self.open.round, config={"in_reply_to": self.open.request_id, "shard": self.shard,
                                                      "accepted": accepted, "refused": refused})

    def _send_partial(self, round_: OpenRound) -> None:
        """The notes still pending, then the PARTIAL; the sums and the reference are let go."""
        self._send_note()
        if round_.masked_sum is not None:
            fields = masked_partial_fields(round_.masked_sum, round_.folded)
        else:
            fields = partial_envelope_fields(self._algorithm().partial() if round_.folded else {}, round_.folded)
        fields["config"].update(in_reply_to=round_.request_id, shard=self.shard)
        self.send(Kind.PARTIAL, round_.round, **fields)
        round_.partial_sent, round_.sent, round_.masked_sum = True, {}, None
        self.partials_sent += 1
        log.info("%s: round %d partial sent (%d folded, %d refused of %d)", self.client_id, round_.round,
                 len(round_.folded), len(round_.refused), len(round_.roster))


def _keep(kept: OrderedDict[str, Envelope], key: str, envelope: Envelope) -> None:
    kept[key] = envelope
    while len(kept) > KEPT_REQUESTS:
        kept.popitem(last=False)

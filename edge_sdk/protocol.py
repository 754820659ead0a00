"""The wire contract shared by devices and the coordinator: message kinds, the envelope, topics.

Everything here is plain Python and numpy so that every device, including weak ones without
PyTorch, can speak the protocol. `docs/PROTOCOL.md` describes the same contract for people
writing a compatible device in another language.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

PROTOCOL_VERSION = 1
TOPIC_ROOT = "edgepfl"
BROADCAST = "all"
COORDINATOR = "coordinator"
RESERVED_IDS = frozenset({BROADCAST, COORDINATOR})
AGGREGATOR_PREFIX = "aggregator-"
"""Client ids `aggregator-<k>` belong to shard aggregators (`edgepfl aggregator --shard k/K`)."""
SHARD_PREFIX = "shard-"
STATISTICS = "statistics"
"""EVALUATE phase and EVAL_RES group: the global body's BatchNorm statistics before a release."""
PROTOTYPES = "prototypes"
"""EVALUATE phase and group (both ways): the weak devices' class prototypes, pooled in a release."""

ArrayGroup = dict[str, np.ndarray]
"""Named arrays; the names are the model's `state_dict` keys (or statistic names)."""


class Kind(str, Enum):
    """Message kinds. The kind is also the last segment of the topic a message travels on."""

    HELLO = "hello"  # up: a device registers (capabilities, device type, examples)
    OFFLINE = "offline"  # up: the device's MQTT Last Will; the broker sends it on a lost connection
    TRAIN_RES = "train_res"  # up: the result of local training (shared arrays or statistics)
    EVAL_RES = "eval_res"  # up: personalized evaluation metrics (and, if allowed, class prototypes)
    FETCH = "fetch"  # up: a device asks for a released artifact by sha256
    SECAGG_RES = "secagg_res"  # up: a device's answer to a secure-aggregation stage (keys, shares, unmasking)
    NOTE = "note"  # up, from a shard aggregator: which of its devices' updates it folded or refused so far
    PARTIAL = "partial"  # up, from a shard aggregator: its shard's weighted sum of changes for one round
    WELCOME = "welcome"  # down, per device: registration accepted, the run's settings
    TRAIN = "train"  # down, broadcast: one round's task and the shared state
    EVALUATE = "evaluate"  # down, broadcast: evaluate the deployed model
    STATUS = "status"  # down, broadcast, retained: the coordinator's state
    RELEASE = "release"  # down, broadcast, retained: manifest of the released representation
    ARTIFACT = "artifact"  # down, per device: the released bytes (chunked), answering FETCH
    ROSTER = "roster"  # down, per aggregator: the round's selected devices of its shard and their examples
    CLOSE = "close"  # down, per aggregator: the round closed, send the partial now
    NACK = "nack"  # down, per device: the coordinator refused one of the device's messages, and why
    SECAGG = "secagg"  # down: a secure-aggregation stage (broadcast), or a device's routed shares (per device)


UP_KINDS = frozenset({Kind.HELLO, Kind.OFFLINE, Kind.TRAIN_RES, Kind.EVAL_RES, Kind.FETCH, Kind.NOTE, Kind.PARTIAL,
                      Kind.SECAGG_RES})
DOWN_KINDS = frozenset({Kind.WELCOME, Kind.TRAIN, Kind.EVALUATE, Kind.STATUS, Kind.RELEASE, Kind.ARTIFACT, Kind.ROSTER,
                        Kind.CLOSE, Kind.NACK, Kind.SECAGG})
SHARD_KINDS = frozenset({Kind.TRAIN_RES})
"""What travels on a shard topic (`edgepfl/<fed>/shard-<k>/<id>/<kind>`): a device's update, to its aggregator."""
NACK_FIELDS = ("in_reply_to", "refused_kind", "reason")
"""A NACK's config, every value a str: the refused message's msg_id, its kind and the reason code."""
REFUSED, REFUSAL_DETAIL = "refused", "detail"
"""The config keys of a device's refusal: a reply (the request's reply kind, `in_reply_to` its
msg_id) that carries no groups or metrics, only the reason code and a detail of at most
`MAX_REFUSAL_DETAIL` characters."""
MAX_REFUSAL_DETAIL = 500
REFUSABLE_REQUESTS = {Kind.TRAIN: Kind.TRAIN_RES, Kind.EVALUATE: Kind.EVAL_RES}
"""The requests a device refuses upward (`refusal_of`), each with the kind of its reply; a
SECAGG stage is refused in its SECAGG_RES its own way (docs/PROTOCOL.md section 19)."""


class Reason(str, Enum):
    """Reason codes for every rejection; they are counted in metrics.jsonl and report.json."""

    TOO_LARGE = "too_large"
    MALFORMED = "malformed"
    BAD_VERSION = "bad_version"
    BAD_KIND = "bad_kind"
    BAD_DTYPE = "bad_dtype"
    BAD_SHAPE = "bad_shape"
    BAD_TOPIC = "bad_topic"
    SENDER_MISMATCH = "sender_mismatch"
    WRONG_RUN = "wrong_run"
    STALE = "stale"
    TOO_STALE = "too_stale"
    DUPLICATE = "duplicate"
    CONFLICTING_REPLY = "conflicting_reply"
    NOT_SELECTED = "not_selected"
    UNKNOWN_DEVICE = "unknown_device"
    UNEXPECTED_ARRAYS = "unexpected_arrays"
    NON_FINITE = "non_finite"
    NORM_TOO_LARGE = "norm_too_large"
    CHUNK_INVALID = "chunk_invalid"
    CHUNK_CHECKSUM = "chunk_checksum"
    CHUNK_OVERFLOW = "chunk_overflow"
    CHUNK_EXPIRED = "chunk_expired"
    UNKNOWN_ARTIFACT = "unknown_artifact"
    MODEL_MISMATCH = "model_mismatch"
    BAD_SIGNATURE = "bad_signature"
    OVER_BUDGET = "over_budget"
    SECAGG_INVALID = "secagg_invalid"
    SECAGG_INCONSISTENT = "secagg_inconsistent"


REPORTED_REFUSALS = frozenset({Reason.MALFORMED, Reason.BAD_DTYPE, Reason.BAD_SHAPE, Reason.UNEXPECTED_ARRAYS,
                               Reason.NON_FINITE, Reason.MODEL_MISMATCH})
"""Why a device refuses a request of its run addressed to it and says so upward: what it was
sent does not fit its model or what it implements. Every other refusal stays silent."""


class ProtocolError(Exception):
    """A message or frame that must be rejected; `reason` is one of `Reason`."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class WireError(ProtocolError):
    """Bytes that do not decode into a valid envelope."""


class ChunkError(ProtocolError):
    """A chunk frame that cannot be accepted or a blob that cannot be reassembled."""


class ValidationError(ProtocolError):
    """A well-formed message that the receiver's state does not allow (stale, unexpected, ...)."""


def new_message_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Envelope:
    """One protocol message. `groups` hold named arrays; `metrics` numbers; `config` settings."""

    kind: Kind
    sender: str
    run_id: str = ""
    round: int = 0
    msg_id: str = field(default_factory=new_message_id)
    timestamp: float = field(default_factory=time.time)
    groups: dict[str, ArrayGroup] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    version: int = PROTOCOL_VERSION

    def array_bytes(self) -> int:
        """Raw tensor bytes carried, the denominator of the wire-overhead ratio."""
        return sum(a.nbytes for group in self.groups.values() for a in group.values())


_CLIENT_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_FEDERATION = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class Refusal:
    """A device's word that it cannot take the request its reply answers: the reason code and why."""

    reason: Reason
    detail: str


def refusal_of(envelope: Envelope) -> Refusal | None:
    """The refusal a reply carries (`REFUSED`, `REFUSAL_DETAIL`), None when it carries none.
    ProtocolError `malformed` when it is not one: a reason that is no reason code, a detail that is
    no text or is longer than `MAX_REFUSAL_DETAIL`, or groups or metrics beside it."""
    reason = envelope.config.get(REFUSED)
    if reason is None:
        return None
    detail = envelope.config.get(REFUSAL_DETAIL)
    if not isinstance(reason, str) or reason not in Reason._value2member_map_:
        raise ProtocolError(Reason.MALFORMED, f"a refusal's reason {reason!r} is not a reason code")
    if not isinstance(detail, str) or len(detail) > MAX_REFUSAL_DETAIL:
        raise ProtocolError(Reason.MALFORMED, f"a refusal's detail is text of at most {MAX_REFUSAL_DETAIL} characters")
    if envelope.groups or envelope.metrics:
        raise ProtocolError(Reason.MALFORMED, "a refusal carries no arrays and no metrics")
    return Refusal(Reason(reason), detail)


def aggregator_id(shard: int) -> str:
    """The client id of shard `shard`'s aggregator."""
    return f"{AGGREGATOR_PREFIX}{shard}"


def shard_of_aggregator(client_id: str) -> int | None:
    """The shard an `aggregator-<k>` id serves; None for any other id."""
    digits = client_id.removeprefix(AGGREGATOR_PREFIX)
    return int(digits) if digits != client_id and digits.isdigit() and digits == str(int(digits)) else None


def check_client_id(client_id: str) -> str:
    """Client ids are topic segments: letters, digits, `_.-`, at most 64, not a reserved name."""
    if not _CLIENT_ID.match(client_id) or client_id in RESERVED_IDS:
        raise ValueError(
            f"invalid client id {client_id!r}: use 1-64 letters, digits, '_', '.', '-' "
            f"(not {' or '.join(sorted(RESERVED_IDS))})"
        )
    return client_id


@dataclass(frozen=True)
class TopicAddress:
    """A parsed topic: direction ('up' or 'down'), the device id (or 'all'), and the kind;
    `shard` is the shard of an update sent to a shard aggregator (direction 'up'), else None."""

    direction: str
    client_id: str
    kind: Kind
    shard: int | None = None


class Topics:
    """Topic names of one federation: `edgepfl/<federation>/{up,down}/<client_id|all>/<kind>`, and
    `edgepfl/<federation>/shard-<k>/<client_id>/train_res` for updates read by shard `k`'s aggregator
    (the client-id level is the sender's, so broker ACLs bind a device to its id there too)."""

    def __init__(self, federation: str):
        if not _FEDERATION.match(federation):
            raise ValueError(f"invalid federation name {federation!r}: use 1-64 letters, digits, '_', '.', '-'")
        self.federation = federation
        self.prefix = f"{TOPIC_ROOT}/{federation}"

    def up(self, client_id: str, kind: Kind) -> str:
        return f"{self.prefix}/up/{client_id}/{kind.value}"

    def down(self, client_id: str, kind: Kind) -> str:
        return f"{self.prefix}/down/{client_id}/{kind.value}"

    def broadcast(self, kind: Kind) -> str:
        return self.down(BROADCAST, kind)

    def all_up(self) -> str:
        """The coordinator's subscription."""
        return f"{self.prefix}/up/+/+"

    def shard(self, shard: int, client_id: str, kind: Kind) -> str:
        """Where a device of shard `shard` sends `kind` (an update) under sharded aggregation."""
        return f"{self.prefix}/{SHARD_PREFIX}{shard}/{client_id}/{kind.value}"

    def shard_updates(self, shard: int) -> str:
        """Shard `shard`'s aggregator's subscription to its devices' updates."""
        return f"{self.prefix}/{SHARD_PREFIX}{shard}/+/{Kind.TRAIN_RES.value}"

    def device_subscriptions(self, client_id: str) -> list[str]:
        """A device reads the broadcast topics and its own downstream topics, nothing else."""
        return [f"{self.prefix}/down/{BROADCAST}/+", f"{self.prefix}/down/{client_id}/+"]

    def parse(self, topic: str) -> TopicAddress:
        parts = topic.split("/")
        shard = _shard_level(parts[2]) if len(parts) == 5 else None
        if (len(parts) != 5 or "/".join(parts[:2]) != self.prefix
                or (parts[2] not in ("up", "down") and shard is None)):
            raise ProtocolError(Reason.BAD_TOPIC, f"topic {topic!r} is not in federation {self.federation!r}")
        try:
            kind = Kind(parts[4])
        except ValueError:
            raise ProtocolError(Reason.BAD_KIND, f"unknown kind in topic {topic!r}") from None
        allowed = SHARD_KINDS if shard is not None else UP_KINDS if parts[2] == "up" else DOWN_KINDS
        if kind not in allowed:
            raise ProtocolError(Reason.BAD_KIND, f"kind {kind.value!r} cannot travel on {parts[2]}")
        return TopicAddress("up" if shard is not None else parts[2], parts[3], kind, shard)


def _shard_level(level: str) -> int | None:
    """k for a topic level `shard-<k>`, else None."""
    digits = level.removeprefix(SHARD_PREFIX)
    return int(digits) if digits != level and digits.isdigit() and digits == str(int(digits)) else None

"""The conversation the kit has with one device, section by section of docs/PROTOCOL.md.

Each section sends what a coordinator may send and judges what comes back; it passes, fails with
the reason, or is skipped where it does not apply to the device's type. Bad requests are judged
with a barrier: after each one the kit sends a good EVALUATE, and a device handles its messages
in order, so once the barrier's reply is in, a reply to the bad request would have come before
it (a quiet window after the last barrier catches devices that answer out of order).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from edge_sdk import signing, wire
from edge_sdk.chunks import MIN_CHUNK_SIZE, chunk_frames, iter_frames
from edge_sdk.codecs import INDEX_SUFFIX, SCALE_SUFFIX
from edge_sdk.protocol import (REFUSED, REPORTED_REFUSALS, ArrayGroup, Envelope, Kind, ProtocolError, Reason,
                               new_message_id, refusal_of)

from ..releases.phase import PrototypePool
from .body import random_features_body, release_metadata
from .checks import accuracy_problem, answers, cached_reply_problem, int8_problems, reply_problems, reply_to
from .coordinator_side import TRAINER, KitCoordinator, KitSettings, RunState
from .outcome import Report, SectionFailed, SectionSkipped, Verdict
from .peer import DevicePeer

log = logging.getLogger(__name__)

FEATURES = 32
"""Feature dimension of the released body (a small one: the kit checks the exchange, not accuracy)."""


class Conformance(KitCoordinator):
    """Plays the coordinator against one device; `run_all()` returns the report."""

    def __init__(self, peer: DevicePeer, settings: KitSettings):
        super().__init__(peer, settings)
        self.report = Report()
        self.prototypes: ArrayGroup | None = None  # pooled from the device's EVAL_RES after the release
        self.requests: dict[str, Envelope] = {}  # the last good request and reply of each section
        self.replies: dict[str, Envelope] = {}

    # -- the sequence ------------------------------------------------------------------------
    def run_all(self) -> Report:
        self.peer.listen()
        self._section("registration", self.registration, needs=())
        lite = self.lite
        steps: list[tuple[str, Callable[[], str], tuple[str, ...]]] = [
            ("release", self.release, ("registration",)),
            ("chunking", self.chunking, ("release",) if lite else ("registration",)),
            ("training", self.training, ("registration",)),
            ("evaluation", self.evaluation, ("release",) if lite else ("registration",)),
            ("duplicates", self.duplicates, ("evaluation",) if lite else ("training",)),
            ("rejection", self.rejection, ("evaluation",)),
            ("signing", self.signing, ()),
            ("nack", self.nack, ("evaluation",)),
            ("rejoin", self.rejoin, ("registration",)),
            ("codecs", self.codecs, ("rejoin",)),
        ]
        for key, step, needs in steps:
            self._section(key, step, needs)
        self._section("envelope", self.envelope, needs=())
        for run_id in self.runs:  # so that a device of either run stops
            self.peer.send(self.peer.envelope(Kind.STATUS, run_id, self.run.round, config=self._status("finished")))
        return self.report

    def _section(self, key: str, step: Callable[[], str], needs: tuple[str, ...]) -> None:
        missing = [need for need in needs if self.report.verdict(need) is not Verdict.PASS]
        if missing:
            self.report.record(key, Verdict.SKIP, f"needs {', '.join(missing)}, which did not pass")
            return
        try:
            self.report.record(key, Verdict.PASS, step())
        except SectionSkipped as skip:
            self.report.record(key, Verdict.SKIP, str(skip))
        except SectionFailed as failure:
            self.report.record(key, Verdict.FAIL, str(failure))
        log.info("%s: %s", key, self.report.outcomes[key].reason)

    # -- requests ----------------------------------------------------------------------------
    def _train(self, round_: int, **changes) -> Envelope:
        """Round `round_`'s TRAIN selecting the device, with the fields in `changes` replaced."""
        request = self.peer.envelope(Kind.TRAIN, self.run.run_id, round_, groups=self.plan.train_groups(round_),
                                     config={"selected": [self.settings.device_id]})
        return replace(request, **changes)

    def _evaluate(self, round_: int, phase: str = "round", **changes) -> Envelope:
        """An EVALUATE selecting the device, with the fields in `changes` replaced."""
        request = self.peer.envelope(Kind.EVALUATE, self.run.run_id, round_,
                                     groups={} if self.lite else self.plan.eval_groups(),
                                     config={"selected": [self.settings.device_id], "final": phase != "round",
                                             "phase": phase})
        return replace(request, **changes)

    def _reply(self, request: Envelope, kind: Kind, what: str) -> Envelope:
        """The device's reply to `request` (sent already), or the section fails."""
        reply = self.peer.wait_for(reply_to(request, kind), self.settings.reply_timeout)
        if reply is None:
            raise SectionFailed(f"no {kind.value.upper()} to {what} within {self.settings.reply_timeout:.0f} s"
                                + self._rejected_note())
        return reply

    def _rejected_note(self) -> str:
        rejected = self.peer.rejections()
        return f" ({', '.join(f'{n} rejected as {r}' for r, n in rejected.items())})" if rejected else ""

    def _checked_reply(self, request: Envelope, kind: Kind, what: str) -> Envelope:
        reply = self._reply(request, kind, what)
        problems = reply_problems(reply, request, self.run.run_id)
        if problems:
            raise SectionFailed(f"{kind.value.upper()} to {what}: " + "; ".join(problems))
        return reply

    def _barrier(self, round_: int) -> Envelope:
        """A good EVALUATE, answered: everything the device sent before its reply is in."""
        request = self.peer.send(self._evaluate(round_))
        self._reply(request, Kind.EVAL_RES, "a good EVALUATE sent after it")
        return request

    # -- the sections ------------------------------------------------------------------------
    def registration(self) -> str:
        self.peer.send(self.peer.envelope(Kind.STATUS, self.run.run_id, 0, config=self._status("registering")))
        hello = self.peer.wait_for(lambda e: e.kind is Kind.HELLO, self.settings.hello_timeout,
                                   give_up=lambda: bool(self.peer.rejections()))
        if hello is None:
            raise SectionFailed(f"no HELLO from {self.settings.device_id} within {self.settings.hello_timeout:.0f} s "
                                f"of a retained STATUS{self._rejected_note()}")
        if self.hello_problem is not None:
            raise SectionFailed(self.hello_problem)
        self.peer.send(self.peer.envelope(Kind.STATUS, self.run.run_id, 0, config=self._status("training")))
        return (f"HELLO from a {hello.config.get('device_type', TRAINER)} with {self.examples} examples of "
                f"{self.plan.config.run.dataset}; WELCOME to fedavg with model {self.plan.config.model_name}")

    def release(self) -> str:
        if not self.lite:
            raise SectionSkipped("trainers fetch no release")
        task = self.plan.config.task()
        self._artifact = random_features_body(task, FEATURES, seed=int(self.run.run_id[:8], 16))
        sha = hashlib.sha256(self.artifact).hexdigest()
        self.damage_next_artifact = True
        mark = self.peer.mark()
        self.peer.send(self.peer.envelope(Kind.RELEASE, self.run.run_id, 2, config={
            "sha256": sha, "size": len(self.artifact), "format": "onnx", "metadata": release_metadata(task, FEATURES)}))
        fetched = lambda e: e.kind is Kind.FETCH and e.config.get("sha256") == sha  # noqa: E731
        if self.peer.wait_for(fetched, self.settings.reply_timeout, since=mark) is None:
            raise SectionFailed(f"no FETCH of {sha[:12]} within {self.settings.reply_timeout:.0f} s of the RELEASE")
        first = self.peer.mark()
        if self.peer.wait_for(fetched, self.settings.reply_timeout, since=first) is None:
            raise SectionFailed("a damaged ARTIFACT (sha256 not the manifest's) was not fetched again")
        request = self.peer.send(self._evaluate(2, "prototypes"))
        reply = self._checked_reply(request, Kind.EVAL_RES, "the EVALUATE after the release")
        problem = accuracy_problem(reply)
        if problem:
            raise SectionFailed(problem)
        shared = ""
        if "prototypes" in reply.groups:
            pool = PrototypePool(self.plan.num_classes, FEATURES)
            try:
                pool.check(reply.groups["prototypes"], self.examples)
            except ProtocolError as err:
                raise SectionFailed(f"EVAL_RES prototypes refused ({err.reason.value}): {err.detail}") from None
            pool.add(reply.groups["prototypes"], self.examples)
            self.prototypes = pool.result()
            shared = f", prototypes [{self.plan.num_classes}, {FEATURES}] accepted"
        self.requests["evaluation"], self.replies["evaluation"] = request, reply
        self.run.round = 2
        return (f"RELEASE -> FETCH -> a damaged ARTIFACT refused and fetched again -> ARTIFACT of "
                f"{len(self.artifact)} bytes -> EVAL_RES accuracy {reply.metrics['accuracy']:.3f}{shared}")

    def chunking(self) -> str:
        """A blob with one damaged frame gets no reply; a chunked request does. A trainer's
        requests are large already; a weak device's are padded to travel chunked."""
        if self.lite:
            bad, good = self._evaluate(self.run.round), self._evaluate(self.run.round)
            frames = chunk_frames(self._padded(bad), MIN_CHUNK_SIZE)
        else:
            bad, good = self._train(1), self._evaluate(1)
            frames = chunk_frames(wire.encode(bad), MIN_CHUNK_SIZE)
        damaged = bytearray(frames[0])
        damaged[-1] ^= 0x01  # the last byte of the first slice: the blob's sha256 no longer matches
        mark = self.peer.mark()
        for frame in [bytes(damaged), *frames[1:]]:
            self.peer.publish(self.peer.topic(bad.kind), frame)
        if self.lite:
            payload = self._padded(good)
            good_frames = chunk_frames(payload, MIN_CHUNK_SIZE)
            for frame in good_frames:
                self.peer.publish(self.peer.topic(good.kind), frame)
            size, count = len(payload), len(good_frames)
        else:
            self.peer.send(good)
            size = len(wire.encode(good))
            count = math.ceil(size / self.peer.channel.chunk_size)
        self._checked_reply(good, Kind.EVAL_RES, "a chunked EVALUATE")
        answered = [e for e in self.peer.since(mark) if answers(e, bad)]
        if answered:
            raise SectionFailed(f"the device answered a {bad.kind.value.upper()} whose blob failed its sha256 "
                                f"(chunk_checksum): {answered[0].kind.value}")
        return (f"a {len(frames)}-frame {bad.kind.value.upper()} with a damaged frame got no reply; a {size}-byte "
                f"EVALUATE in {count} frames was answered")

    def _padded(self, envelope: Envelope) -> bytes:
        """`envelope` with an unknown top-level key of 20 kB (ignored by receivers, §14), so that
        it travels chunked."""
        pieces: list = []
        wire.pack_pieces({**wire.envelope_to_dict(envelope), "padding": memoryview(bytes(20_000))}, pieces)
        return b"".join(bytes(piece) for piece in pieces)

    def training(self) -> str:
        if self.lite:
            raise SectionSkipped("lite devices never train (§10)")
        request = self.peer.send(self._train(1))
        reply = self._checked_reply(request, Kind.TRAIN_RES, "the round-1 TRAIN")
        try:
            weight = self.plan.check_update(reply, request, self.examples, self.run.codec)
        except ProtocolError as err:
            raise SectionFailed(f"TRAIN_RES refused by the coordinator's checks ({err.reason.value}): "
                                f"{err.detail}") from None
        self.requests["training"], self.replies["training"] = request, reply
        self.run.round = 1
        size = len(wire.encode(request))
        frames = math.ceil(size / self.peer.channel.chunk_size)
        arrays = sum(len(group) for group in reply.groups.values())
        return (f"TRAIN of {size} bytes in {frames} frames -> TRAIN_RES of {arrays} arrays, num_examples "
                f"{reply.metrics.get('num_examples')}, accepted with weight {weight:g}")

    def evaluation(self) -> str:
        if self.lite:  # the final pass, with the global prototypes when the device shared its own
            prototypes = {"prototypes": self.prototypes} if self.prototypes is not None else {}
            request = self.peer.send(self._evaluate(self.run.round, "final", groups=prototypes))
        else:
            request = self.peer.send(self._evaluate(self.run.round))
        reply = self._checked_reply(request, Kind.EVAL_RES, "the EVALUATE")
        problem = accuracy_problem(reply)
        if problem:
            raise SectionFailed(problem)
        self.requests["evaluation"], self.replies["evaluation"] = request, reply
        return f"EVAL_RES accuracy {reply.metrics['accuracy']:.3f}"

    def duplicates(self) -> str:
        key = "evaluation" if self.lite else "training"
        request, first = self.requests[key], self.replies[key]
        mark = self.peer.mark()
        # the same envelope, msg_id included, as a coordinator re-publishes it after a reconnection; sent
        # whole: frames identical to the first copy's would be dropped as a blob already completed (§5)
        self.peer.publish(self.peer.topic(request.kind), wire.encode(request))
        repeat = self.peer.wait_for(lambda e: e.kind is first.kind, self.settings.reply_timeout, since=mark)
        if repeat is None:
            raise SectionFailed(f"no reply to a repeated {request.kind.value.upper()} (same msg_id): a device re-sends "
                                "its cached reply (§6)")
        problem = cached_reply_problem(repeat, first)
        if problem:
            raise SectionFailed(problem)
        self._barrier(self.run.round)
        extra = [e for e in self.peer.since(mark, first.kind) if e.msg_id != first.msg_id and answers(e, request)]
        if extra:
            raise SectionFailed(f"the repeated {request.kind.value.upper()} was also answered anew (msg_id "
                                f"{extra[0].msg_id})")
        return (f"the repeated {request.kind.value.upper()} got the cached {first.kind.value.upper()} (msg_id "
                f"{first.msg_id[:12]}..., same arrays and metrics)")

    def rejection(self) -> str:
        round_ = self.run.round + 1
        base = self._evaluate if self.lite else self._train
        shape_group = "prototypes" if self.lite else "shared"
        wrong_shape = ({"counts": np.zeros(self.plan.num_classes + 1, np.int64),
                        "means": np.zeros((self.plan.num_classes + 1, FEATURES), np.float32)} if self.lite
                       else _grown(self.plan.train_groups(round_)["shared"]))
        other = Kind.TRAIN if self.lite else Kind.EVALUATE
        wrong = base(round_, groups={shape_group: wrong_shape})
        bad = [
            ("of another run", base(round_, run_id="0" * 16), None),
            ("that does not select it", base(round_, config={"selected": [f"not-{self.settings.device_id}"]}), None),
            ("with arrays of the wrong shape", wrong, None),
            (f"published on the {other.value} topic (bad_kind)", base(round_), self.peer.topics.broadcast(other)),
            ("of protocol version 2 (bad_version)", base(round_, version=2), None),
        ]
        kind = Kind.EVAL_RES if self.lite else Kind.TRAIN_RES
        start = self.peer.mark()
        refusals: list[Envelope] = []
        for what, request, topic in bad:
            mark = self.peer.mark()
            self.peer.send(request, topic)
            barrier = self._barrier(self.run.round)
            replies = [e for e in self.peer.since(mark, kind) if answers(e, request)
                       or (not answers(e, barrier) and "in_reply_to" not in e.config)]
            if request is wrong:  # a request of its run for it that it cannot take: refused upward, or silence
                refusals = [e for e in replies if answers(e, request) and _reported_refusal(e)]
                replies = [e for e in replies if e not in refusals]
            if replies:
                raise SectionFailed(f"the device answered a {request.kind.value.upper()} {what} "
                                    f"({kind.value} msg_id {replies[0].msg_id[:12]}...)")
        self.peer.drain(self.settings.quiet_seconds)
        late = [what for what, request, _ in bad
                if any(answers(e, request) and e not in refusals for e in self.peer.since(start))]
        if late:
            raise SectionFailed(f"the device answered a request {late[0]} (late, after the barrier)")
        hellos = len(self.peer.since(start, Kind.HELLO))
        refused = (f"the wrong shape refused upward ({refusals[0].config[REFUSED]}, §11)" if refusals
                   else "the wrong shape left unanswered (refusing it upward is optional, §11)")
        return (f"no reply to {len(bad) - 1} bad {base(round_).kind.value.upper()}s (another run, not selected, wrong "
                f"topic, version 2), {refused}; HELLO x{hellos} (§12: a request of another run asks for one)")

    def signing(self) -> str:
        key = self.settings.signing_key
        if key is None:
            raise SectionSkipped("no signing key given (--signing-key or --credentials)")
        forged = self.peer.rejections().get(Reason.BAD_SIGNATURE.value, 0)
        if forged:
            raise SectionFailed(f"{forged} messages on up/{self.settings.device_id}/... were not sealed with the "
                                "device's key (bad_signature)")
        if self.report.verdict("evaluation") is not Verdict.PASS:
            raise SectionSkipped("needs evaluation, which did not pass")
        request = self._evaluate(self.run.round)
        sealed = signing.seal(key, wire.encode_pieces(request))
        for frame in iter_frames(sealed, self.peer.channel.chunk_size):  # a sealed message may travel chunked
            self.peer.publish(self.peer.topic(Kind.EVALUATE), frame)
        self._checked_reply(request, Kind.EVAL_RES, "a sealed EVALUATE")
        verified = sum(self.peer.kinds().values())
        return (f"all {verified} messages from the device so far carried a valid seal of its key (HMAC-SHA256); a "
                "sealed EVALUATE was unwrapped and answered")

    def nack(self) -> str:
        refused = self.replies.get("training") or self.replies["evaluation"]
        nack = self.peer.envelope(Kind.NACK, self.run.run_id, self.run.round, config={
            "in_reply_to": refused.msg_id, "refused_kind": refused.kind.value, "reason": Reason.STALE.value})
        mark = self.peer.mark()
        self.peer.send(nack)
        self._barrier(self.run.round)
        answered = [e for e in self.peer.since(mark) if answers(e, nack)]
        if answered:
            raise SectionFailed(f"the device answered a NACK with a {answered[0].kind.value}")
        return f"a NACK refusing its {refused.kind.value} as stale; the device answered the next EVALUATE"

    def _new_run(self, codec: str) -> None:
        """A new incarnation with a new run of upload codec `codec`: the device registers again."""
        self.run = RunState(new_message_id()[:16], new_message_id()[:12], codec)
        self.runs.append(self.run.run_id)
        mark = self.peer.mark()
        self.peer.send(self.peer.envelope(Kind.STATUS, self.run.run_id, 0, config=self._status("registering")))
        if self.peer.wait_for(lambda e: e.kind is Kind.HELLO, self.settings.hello_timeout, since=mark) is None:
            raise SectionFailed(f"no HELLO within {self.settings.hello_timeout:.0f} s of a STATUS with a new "
                                "incarnation (a restarted coordinator)")
        self.peer.send(self.peer.envelope(Kind.STATUS, self.run.run_id, 0, config=self._status("training")))

    def rejoin(self) -> str:
        previous = self.run.run_id
        self._new_run("fp32" if self.lite else "int8")
        if self.lite:
            sha = hashlib.sha256(self.artifact).hexdigest()
            self.peer.send(self.peer.envelope(Kind.RELEASE, self.run.run_id, 2, config={
                "sha256": sha, "size": len(self.artifact), "format": "onnx",
                "metadata": release_metadata(self.plan.config.task(), FEATURES)}))
            request = self.peer.send(self._evaluate(2, "final"))
            self._checked_reply(request, Kind.EVAL_RES, "an EVALUATE of the new run")
            self.run.round = 2
            answered = "EVAL_RES"
        else:
            request = self.peer.send(self._train(1))
            reply = self._checked_reply(request, Kind.TRAIN_RES, "a TRAIN of the new run")
            self.requests["codecs"], self.replies["codecs"] = request, reply
            self.run.round = 1
            answered = "TRAIN_RES"
        return (f"STATUS of a new incarnation -> HELLO -> WELCOME of run {self.run.run_id} (was {previous}) -> "
                f"{answered} of the new run")

    def codecs(self) -> str:
        if self.lite:
            raise SectionSkipped("lite devices upload no updates")
        request, reply = self.requests["codecs"], self.replies["codecs"]
        problems = int8_problems(reply.groups)
        if problems:
            raise SectionFailed("int8 upload: " + "; ".join(problems[:3]))
        self._accepted(reply, request, "int8")
        found = [f"int8 ({_count(reply, SCALE_SUFFIX)} int8 arrays with their scales)"]
        for codec, side in (("topk", INDEX_SUFFIX), ("q4", SCALE_SUFFIX)):  # a run of each, trained once
            self._new_run(codec)
            request = self.peer.send(self._train(1))
            reply = self._checked_reply(request, Kind.TRAIN_RES, f"a TRAIN of a run with upload_codec {codec}")
            self.run.round = 1
            self._accepted(reply, request, codec)
            found.append(f"{codec} ({_count(reply, side)} encoded arrays)")
        return f"runs with upload_codec {', '.join(found)}: decoded and accepted"

    def _accepted(self, reply: Envelope, request: Envelope, codec: str) -> None:
        """Section 8: the coordinator decodes the `codec` upload `reply` and accepts it."""
        try:
            self.plan.check_update(reply, request, self.examples, codec)
        except ProtocolError as err:
            raise SectionFailed(f"{codec} TRAIN_RES refused by the coordinator's checks ({err.reason.value}): "
                                f"{err.detail}") from None

    def envelope(self) -> str:
        rejected = {reason: n for reason, n in self.peer.rejections().items() if reason != Reason.BAD_SIGNATURE.value}
        if rejected:
            raise SectionFailed("messages from the device were rejected: "
                                + ", ".join(f"{n} as {reason}" for reason, n in rejected.items()))
        kinds = self.peer.kinds()
        if not kinds:
            raise SectionSkipped("the device sent nothing")
        return f"{sum(kinds.values())} messages decoded (" + ", ".join(f"{k} x{n}" for k, n in kinds.items()) + ")"


def _count(reply: Envelope, suffix: str) -> int:
    """How many arrays of `reply` are named `<name><suffix>` (one per encoded array)."""
    return sum(1 for group in reply.groups.values() for key in group if key.endswith(suffix))


def _reported_refusal(reply: Envelope) -> bool:
    """A reply that is a well-formed refusal (§11) for a reason devices report."""
    try:
        refusal = refusal_of(reply)
    except ProtocolError:
        return False
    return refusal is not None and refusal.reason in REPORTED_REFUSALS


def _grown(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` with the first one a row longer than the run's model has it."""
    first = next(iter(arrays))
    value = arrays[first]
    grown = np.zeros((value.shape[0] + 1, *value.shape[1:]) if value.ndim else (2,), value.dtype)
    return {**arrays, first: grown}

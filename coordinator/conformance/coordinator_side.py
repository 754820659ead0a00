"""The kit's side of a run as a coordinator: the run it plays, and its answers to the device.

What the device under test registers with and fetches from, whatever section is playing: a
HELLO is checked (its device type and example count, docs/PROTOCOL.md section 9) and answered
with a WELCOME to the run the kit plays now (its `Plan`, made on the first valid HELLO); a
FETCH of the released sha256 is answered with the ARTIFACT (damaged once, when a section asks).
`KitSettings` is how the kit talks to the device, `RunState` the run it currently plays.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from edge_sdk.protocol import Envelope, Kind, new_message_id

from .outcome import SectionFailed
from .peer import DevicePeer
from .plan import Plan, PlanError

TRAINER, LITE = "trainer", "lite"


@dataclass(frozen=True)
class KitSettings:
    """How the kit talks to the device under test (`edgepfl conformance` flags)."""

    device_id: str
    dataset: str | None = None
    """The built-in task to play (default: the one the device's HELLO names)."""
    model: str = "auto"
    signing_key: bytes | None = None
    hello_timeout: float = 60.0
    """How long to wait for a HELLO (a device without the retained STATUS says HELLO every 15 s)."""
    reply_timeout: float = 120.0
    quiet_seconds: float = 1.0
    """After the last barrier, how long the kit still listens for replies to bad requests."""


@dataclass
class RunState:
    """The run the kit currently plays (a new one after the rejoin)."""

    run_id: str
    incarnation: str
    codec: str
    round: int = 0


class KitCoordinator:
    """The coordinator the device talks to: the run, the device's registration, the release."""

    def __init__(self, peer: DevicePeer, settings: KitSettings):
        self.peer = peer
        self.settings = settings
        self.run = RunState(new_message_id()[:16], new_message_id()[:12], "fp32")
        self.hello: Envelope | None = None
        self.hello_problem: str | None = None
        self._plan: Plan | None = None
        self._artifact: bytes | None = None
        self.damage_next_artifact = False
        self.runs = [self.run.run_id]
        peer.responder = self._respond

    def _respond(self, envelope: Envelope) -> None:
        if envelope.kind is Kind.HELLO:
            self._welcome(envelope)
        elif envelope.kind is Kind.FETCH:
            self._serve(envelope)

    def _welcome(self, hello: Envelope) -> None:
        """Section 9's HELLO checks, then a WELCOME to the run the kit plays now."""
        device_type = hello.config.get("device_type", TRAINER)
        examples = hello.metrics.get("num_examples")
        if device_type not in (TRAINER, LITE):
            self.hello_problem = f"HELLO config.device_type is {device_type!r}, not trainer or lite (malformed)"
        elif not isinstance(examples, (int, float)) or not math.isfinite(examples) or examples < 1:
            self.hello_problem = f"HELLO metrics.num_examples is {examples!r}, not a finite number >= 1 (malformed)"
        if self.hello_problem is not None:
            return
        self.hello = hello
        if self._plan is None:
            try:
                self._plan = Plan.for_task(self.settings.dataset or str(hello.config.get("task")),
                                          model=self.settings.model)
            except PlanError as exc:
                self.hello_problem = str(exc)
                return
        config = self.plan.welcome(self.run.incarnation, self.run.codec)
        self.peer.send(self.peer.envelope(Kind.WELCOME, self.run.run_id, self.run.round, config=config))

    def _serve(self, fetch: Envelope) -> None:
        """An ARTIFACT for a FETCH of the released sha256 (damaged once, when asked to)."""
        if self._artifact is None or fetch.config.get("sha256") != hashlib.sha256(self._artifact).hexdigest():
            return
        body = np.frombuffer(self.artifact, np.uint8).copy()
        if self.damage_next_artifact:
            body[len(body) // 2] ^= 0xFF
            self.damage_next_artifact = False
        self.peer.send(self.peer.envelope(Kind.ARTIFACT, self.run.run_id, self.run.round,
                                          groups={"artifact": {"onnx": body}},
                                          config={"sha256": hashlib.sha256(self.artifact).hexdigest()}))

    def _status(self, state: str) -> dict:
        return {"state": state, "incarnation": self.run.incarnation, "epoch": 1, "rounds": 2, "algorithm": "fedavg"}

    @property
    def plan(self) -> Plan:
        """The run the kit plays, made on the device's first valid HELLO."""
        if self._plan is None:
            raise SectionFailed("no run to play: the device did not register")
        return self._plan

    @property
    def artifact(self) -> bytes:
        """The released representation's bytes."""
        if self._artifact is None:
            raise SectionFailed("nothing was released")
        return self._artifact

    @property
    def registered(self) -> Envelope:
        """The device's last valid HELLO."""
        if self.hello is None:
            raise SectionFailed("the device did not register")
        return self.hello

    @property
    def lite(self) -> bool:
        return self.hello is not None and self.hello.config.get("device_type") == LITE

    @property
    def examples(self) -> int:
        return int(self.registered.metrics["num_examples"])

"""`edgepfl release serve`: weak devices personalize on the current release after training ended.

The service speaks the coordinator's side of the weak-device protocol for a finished run, for as
long as it runs: a retained STATUS `serving` (devices that come online register with HELLO), a
WELCOME with the run's settings (trainers are refused: training is over), the retained RELEASE
manifest of the current version, FETCH answered for any stored version, and one EVALUATE per
device that does not run the current version yet, carrying the class prototypes the devices
pooled on that version. Every EVAL_RES updates the inventory (which version the device runs,
how well it scored, whether it kept an older one and why) and the version's prototype pool.

A staged rollout (`edgepfl release promote N`) sends version N to a seeded `fraction` of the
online weak devices (their own RELEASE topic) and asks them to evaluate it; when every canary
answered (or `canary_timeout` passed) N is promoted, if their mean accuracy with N holds within
the tolerance against their mean with the current release, and goes to the whole fleet; else the
canaries are sent the current release back (`rollback`), and the reason is recorded. A rollback
(`edgepfl release rollback`) sends the earlier release to the whole fleet the same way.

What it keeps is in the run folder (`releases/`): killed and restarted it goes on where it was,
and after a broker outage it publishes its status, the manifest and the open requests again.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.channel import Channel, Received
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, ProtocolError, Reason, new_message_id

from ..fleet.devices import DeviceRegistry
from ..fleet.nacks import NackLimiter
from ..fleet.outbox import Outbox, RunPosition, resent
from ..run.ledger import Ledger
from .inventory import Inventory
from .phase import PROTOTYPES
from .prototypes import PrototypeShares
from .store import ReleaseStore, ReleaseVersion

log = logging.getLogger(__name__)

SERVING = "serving"
"""The STATUS state of a release service."""


class ReleaseService:
    """Serves the releases of the finished run in `run_dir` over `channel` until `stop` is set.

    `run_id`, `algorithm` and `settings` (the training settings its WELCOME carries) are the
    finished run's; `num_classes` its task's."""

    def __init__(self, run_dir: str | Path, channel: Channel, *, run_id: str, rounds: int, algorithm: str,
                 settings: Mapping[str, Any], num_classes: int, canary_timeout: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.store = ReleaseStore(run_dir)
        self.inventory = Inventory(run_dir)
        self.prototypes = PrototypeShares(self.store.dir, num_classes)
        self._versions: dict[int, ReleaseVersion] = {}  # read once: a version never changes
        self._data: dict[int, bytes] = {}  # the bytes of the versions fetched, checked once
        self.channel = channel
        self.topics = channel.topics
        self.algorithm, self.settings, self.num_classes = algorithm, dict(settings), num_classes
        self.canary_timeout = canary_timeout
        self.clock = clock
        self.registry = DeviceRegistry()
        self.incarnation = new_message_id()[:12]
        self.outbox = Outbox(channel, self.registry, Ledger(channel), RunPosition(run_id, rounds), NackLimiter(clock))
        self.state = self.store.read_state()
        if self.state.current is None:
            raise FileNotFoundError(f"{run_dir} holds no release: a run releases with --release (or an algorithm that "
                                    "releases, such as repper), or `edgepfl release publish` adds one")
        self._asked: dict[str, tuple[Envelope, int]] = {}  # device -> (its open EVALUATE, the version asked)
        self._runs: dict[str, Any] = {}  # device -> the sha256 of the release it runs (its HELLO, then its evaluations)
        self._connections = getattr(channel.transport, "connections", 0)
        self._rollout_deadline: float | None = None
        self._next_look = 0.0  # when to read releases/state.json again

    @property
    def run_id(self) -> str:
        return self.outbox.position.run_id

    def run(self, stop: threading.Event) -> None:
        """Serve until `stop` is set; the retained status and manifest stay for the next start."""
        self.channel.transport.subscribe(self.topics.all_up())
        self._announce()
        log.info("serving release %d of run %s", self.state.current, self.run_id)
        while not stop.is_set():
            self._check_reconnection()
            if self.clock() >= self._next_look:
                self._next_look = self.clock() + 0.5
                self._follow_state()
            received = self.channel.receive(0.5)
            if received is None:
                continue
            try:
                self._handle(received)
            finally:
                del received
                self.channel.release()

    # -- what every device sees ------------------------------------------------------------
    def _announce(self) -> None:
        """The retained STATUS and the current release's retained manifest."""
        status = Envelope(Kind.STATUS, COORDINATOR, run_id=self.run_id, round=self.outbox.position.completed,
                          config={"state": SERVING, "incarnation": self.incarnation, "epoch": self._connections,
                                  "algorithm": self.algorithm, "release": self.state.current})
        self.outbox.send(self.topics.broadcast(Kind.STATUS), status, retain=True)
        self._publish_current()

    def _publish_current(self) -> None:
        current = self._current()
        manifest = Envelope(Kind.RELEASE, COORDINATOR, run_id=self.run_id, round=current.version,
                            config=current.manifest(rollback=self._rolled_back()))
        self.outbox.send(self.topics.broadcast(Kind.RELEASE), manifest, retain=True)

    def _rolled_back(self) -> bool:
        """Whether the current release is older than one the fleet was given before: its manifest
        then says `rollback`, so that devices follow it even where it scores lower (after a
        restart of the service too)."""
        promoted = [entry["version"] for entry in self.state.history if entry["action"] == "promoted"]
        return self.state.current is not None and any(version > self.state.current for version in promoted)

    def _current(self) -> ReleaseVersion:
        assert self.state.current is not None  # checked at construction; never unset after
        return self._release(self.state.current)

    def _check_reconnection(self) -> None:
        """After the broker connection came back: the status, the manifest and the open requests again."""
        connections = getattr(self.channel.transport, "connections", 0)
        if connections == self._connections or not getattr(self.channel.transport, "subscriptions_active",
                                                            lambda: True)():
            return
        self._connections = connections
        log.warning("broker connection re-established; publishing status, release and open requests again")
        self._announce()
        for device, (request, _) in self._asked.items():
            self.outbox.send(self.topics.down(device, Kind.EVALUATE), resent(request))

    # -- messages --------------------------------------------------------------------------
    def _handle(self, received: Received) -> None:
        envelope = received.envelope
        if envelope.kind is Kind.HELLO:
            self._hello(envelope)
        elif envelope.kind is Kind.OFFLINE:
            self.registry.mark_offline(envelope.sender)
        elif envelope.kind is Kind.FETCH:
            self._fetch(envelope)
        elif envelope.kind is Kind.EVAL_RES:
            self._evaluation(envelope)
        else:
            self.outbox.reject(envelope, Reason.STALE, f"{envelope.kind.value} from {envelope.sender}: training of "
                                                       f"run {self.run_id} has ended; only weak devices are served")

    def _hello(self, hello: Envelope) -> None:
        if hello.config.get("device_type") != "lite":
            refusal = (f"run {self.run_id} has finished training; its release service answers weak devices "
                       "(lite-client) only")
            self.outbox.reject(hello, Reason.MALFORMED, f"HELLO from {hello.sender}: {refusal}")
            self.outbox.send(self.topics.down(hello.sender, Kind.WELCOME),
                             Envelope(Kind.WELCOME, COORDINATOR, run_id=self.run_id, config={"refused": refusal}))
            return
        examples = hello.metrics.get("num_examples", 0)
        self.registry.register(hello.sender, "lite", int(examples) if isinstance(examples, (int, float)) else 0,
                               hello.config)
        self._runs[hello.sender] = hello.config.get("runs")
        welcome = Envelope(Kind.WELCOME, COORDINATOR, run_id=self.run_id, round=self.outbox.position.completed,
                           config={"incarnation": self.incarnation, "algorithm": self.algorithm, "hyper": {},
                                   "assignment": None, "settings": self.settings})
        self.outbox.send(self.topics.down(hello.sender, Kind.WELCOME), welcome)
        log.info("registered weak device %s (runs release %s)", hello.sender, self.inventory.runs(hello.sender))
        rollout = self.state.rollout
        if rollout is not None and hello.sender in rollout.canaries and hello.sender not in rollout.results:
            self._ask(hello.sender, self._release(rollout.candidate), canary=True)
        elif self._needs(hello.sender, self._current()):
            self._ask(hello.sender, self._current())

    def _needs(self, device: str, release: ReleaseVersion) -> bool:
        """Whether `device` is to evaluate `release`: it does not run it (as its HELLO, or its
        evaluation since, said: a reinstalled device runs nothing), unless it evaluated it and
        kept the older release it still runs."""
        runs = self._runs.get(device)
        if runs == release.sha256:
            return False
        entry = self.inventory.devices.get(device, {})
        return not (entry.get("evaluated") == release.version and runs is not None and entry.get("sha256") == runs)

    def _ask(self, device: str, release: ReleaseVersion, *, canary: bool = False, rollback: bool = False) -> None:
        """Ask `device` to evaluate `release`: its manifest on the device's own topic first when it
        is not the broadcast one (a canary's candidate, a rollback to the canaries)."""
        if canary or rollback:
            manifest = Envelope(Kind.RELEASE, COORDINATOR, run_id=self.run_id, round=release.version,
                                config=release.manifest(rollback=rollback))
            self.outbox.send(self.topics.down(device, Kind.RELEASE), manifest)
        open_request = self._asked.get(device)
        if open_request is not None and open_request[1] == release.version:  # asked already: the same request
            self.outbox.send(self.topics.down(device, Kind.EVALUATE), resent(open_request[0]))
            return
        groups = self.prototypes.pooled(release)
        request = Envelope(Kind.EVALUATE, COORDINATOR, run_id=self.run_id, round=release.version, groups=groups,
                           config={"selected": [device], "final": True, "phase": "release",
                                   "version": release.version})
        self._asked[device] = (request, release.version)
        self.outbox.send(self.topics.down(device, Kind.EVALUATE), request)

    def _fetch(self, fetch: Envelope) -> None:
        wanted = fetch.config.get("sha256")
        release = self._with_sha(wanted)
        if fetch.sender not in self.registry.devices:
            self.outbox.reject(fetch, Reason.UNKNOWN_DEVICE, f"FETCH from {fetch.sender}, never registered")
        elif release is None:
            self.outbox.reject(fetch, Reason.UNKNOWN_ARTIFACT, f"FETCH of {str(wanted)[:16]!r} from {fetch.sender}")
        else:
            data = self._bytes(release.version)
            artifact = Envelope(Kind.ARTIFACT, COORDINATOR, run_id=self.run_id, round=release.version,
                                groups={"artifact": {"onnx": np.frombuffer(data, dtype=np.uint8)}},
                                config={"sha256": release.sha256})
            self.outbox.send(self.topics.down(fetch.sender, Kind.ARTIFACT), artifact)
            log.info("release %d sent to %s", release.version, fetch.sender)

    def _evaluation(self, result: Envelope) -> None:
        asked = self._asked.get(result.sender)
        if asked is None or result.config.get("in_reply_to") != asked[0].msg_id:
            self.outbox.reject(result, Reason.STALE, f"EVAL_RES from {result.sender} answers no open request")
            return
        version = asked[1]
        release = self._release(version)
        accuracy = result.metrics.get("accuracy")
        if not isinstance(accuracy, (int, float)) or isinstance(accuracy, bool) or not 0.0 <= accuracy <= 1.0:
            self.outbox.reject(result, Reason.MALFORMED, f"evaluation from {result.sender}: accuracy {accuracy!r}")
            return
        if PROTOTYPES in result.groups:
            try:
                self.prototypes.add(result.sender, release, result.groups[PROTOTYPES],
                                    self.registry.devices[result.sender].num_examples)
            except ProtocolError as err:
                self.outbox.reject(result, err.reason, f"prototypes from {result.sender}: {err.detail}")
                return
        del self._asked[result.sender]
        runs = self._version_of(result.config.get("runs"), default=version)
        deployed = result.metrics.get("deployed_accuracy", accuracy)
        kept = result.config.get("kept") if isinstance(result.config.get("kept"), str) else None
        before = self.inventory.accuracy_with(result.sender, self.state.current or version)
        self.inventory.record(result.sender, runs=runs, runs_sha256=self._sha_of(runs), accuracy=float(deployed),
                              evaluated=version, evaluated_accuracy=float(accuracy), kept=kept)
        self._runs[result.sender] = self._sha_of(runs)
        log.info("%s evaluated release %d: %.4f; runs release %s%s", result.sender, version, accuracy, runs,
                 f" (kept: {kept})" if kept else "")
        rollout = self.state.rollout
        if rollout is not None and version == rollout.candidate and result.sender in rollout.canaries:
            self._canary_result(result.sender, float(accuracy), before)

    def _release(self, version: int) -> ReleaseVersion:
        if version not in self._versions:
            self._versions[version] = self.store.get(version)
        return self._versions[version]

    def _bytes(self, version: int) -> bytes:
        if version not in self._data:
            self._data[version] = self.store.data(version)
        return self._data[version]

    def _with_sha(self, sha256: Any) -> ReleaseVersion | None:
        """The kept version with these bytes (the list read again for one published since)."""
        found = next((v for v in self._versions.values() if v.sha256 == sha256), None)
        if found is None:
            self._versions.update((v.version, v) for v in self.store.versions())
            found = next((v for v in self._versions.values() if v.sha256 == sha256), None)
        return found

    def _version_of(self, sha256: Any, *, default: int) -> int:
        found = self._with_sha(sha256)
        return default if found is None else found.version

    def _sha_of(self, version: int) -> str:
        return self._release(version).sha256

    # -- the operator's commands, through releases/state.json -------------------------------
    def _follow_state(self) -> None:
        """Act on what `edgepfl release promote | rollback` changed, and on a rollout's end."""
        state = self.store.read_state()
        if state.current != self.state.current:
            log.warning("release %s is current now (was %s)", state.current, self.state.current)
            self.state = state
            self._to_fleet()
        elif self.state.rollout is not None and state.rollout is None:  # rolled back by the operator
            canaries = self.state.rollout.canaries
            self.state = state
            self._back_to_current(canaries)
        else:
            self.state = state
        rollout = self.state.rollout
        if rollout is not None and not rollout.canaries:
            self._start_rollout()
        elif rollout is not None and self._rollout_deadline is not None and self.clock() > self._rollout_deadline:
            self._decide()

    def _to_fleet(self) -> None:
        """The current release to every online weak device that has not evaluated it (to every
        one after a rollback: each follows it)."""
        self._publish_current()
        current, rollback = self._current(), self._rolled_back()
        for device in self.registry.online("lite"):
            if self._needs(device, current) or rollback:
                self._ask(device, current, rollback=rollback)

    def _back_to_current(self, canaries: list[str]) -> None:
        for device in canaries:
            if device in self.registry.online("lite"):
                self._ask(device, self._current(), rollback=True)

    def _start_rollout(self) -> None:
        rollout = self.state.rollout
        assert rollout is not None
        eligible = [d for d in self.registry.online("lite")
                    if self.inventory.accuracy_with(d, self.state.current or 0) is not None]
        if not eligible:
            return  # no weak device online that runs the current release yet: try again on the next tick
        count = max(1, math.ceil(rollout.fraction * len(eligible)))
        canaries = sorted(random.Random(f"rollout-{rollout.candidate}").sample(eligible, count))
        with self.store.state() as state:
            if state.rollout is None or state.rollout.candidate != rollout.candidate:
                return
            state.rollout.canaries = canaries
            state.note("canaries", rollout.candidate, ", ".join(canaries))
            self.state = state
        self._rollout_deadline = self.clock() + self.canary_timeout
        candidate = self._release(rollout.candidate)
        log.info("rolling release %d out to %d canaries first: %s", candidate.version, len(canaries),
                 ", ".join(canaries))
        for device in canaries:
            self._ask(device, candidate, canary=True)

    def _canary_result(self, device: str, accuracy: float, before: float | None) -> None:
        with self.store.state() as state:
            if state.rollout is None:
                return
            state.rollout.results[device] = {"candidate": accuracy, "current": accuracy if before is None else before}
            self.state = state
        if set(self.state.rollout.canaries) <= set(self.state.rollout.results):  # type: ignore[union-attr]
            self._decide()

    def _decide(self) -> None:
        """Promote the candidate or send the canaries back, with the reason on record."""
        self._rollout_deadline = None
        with self.store.state() as state:
            rollout = state.rollout
            if rollout is None:
                return
            promote, reason = rollout.verdict(state.current or 0)
            state.rollout = None
            if promote:
                state.current = rollout.candidate
                state.note("promoted", rollout.candidate, reason)
            else:
                state.note("rolled back", rollout.candidate, reason)
            self.state = state
        log.warning("release %d %s: %s", rollout.candidate, "promoted" if promote else "rolled back", reason)
        if promote:
            self._to_fleet()
        else:
            self._back_to_current(rollout.canaries)

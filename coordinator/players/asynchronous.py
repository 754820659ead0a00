"""`AsynchronousSteps`: a run's aggregation steps under `--mode async` (coordinator/rounds/async_steps.py).

The coordinator keeps up to `concurrency` devices training on the latest state, each sent its
own TRAIN; every update that arrives is checked against what its version sent, rebased on the
current state with its staleness weight and folded into the open step (too stale, it is refused
as `too_stale`); a step closes once `buffer` of them are in, or at the timeout with those in
(aborted with none). A device that registers again while it trains is sent its TRAIN again.
"""

from __future__ import annotations

import logging

from edge_sdk.channel import Received
from edge_sdk.codecs import UploadCodec
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, ProtocolError, Reason

from ..aggregation.validation import checked_update
from ..events import RoundAggregated, RoundDevices, RoundStarted, UpdateAccepted
from ..fleet.outbox import resent
from ..rounds.async_steps import AsyncSteps, rebase, staleness_factor
from ..rounds.collector import Outcome
from .base import TrainedRound
from .context import RunContext
from .exchange import Exchange

log = logging.getLogger(__name__)


class AsynchronousSteps:
    """Plays buffered asynchronous aggregation steps (a `RoundPlayer`)."""

    label = "step"

    def __init__(self, run: RunContext, exchange: Exchange):
        self.run, self.exchange = run, exchange
        settings = run.config.round
        self.steps = AsyncSteps(buffer=settings.buffer, max_staleness=settings.max_staleness,
                                concurrency=settings.concurrency, exponent=settings.staleness_exponent,
                                seed=run.config.training.seed, version=run.completed)
        """The devices in flight and the versions they train on."""
        self._step_open = False  # the algorithm's accumulators take the next step's arrivals
        self._step_replied: list[str] = []  # the devices whose updates the open step folded, in order
        self._step_missing: set[str] = set()  # devices in flight that went offline during the step

    def play(self, step: int, started: float) -> TrainedRound:
        """Keep up to `concurrency` devices training on the latest state, fold arrivals in as
        they come (`takes`), and close the step once `buffer` of them are in, or at the
        timeout with those in (aborted with none)."""
        run, steps, exchange = self.run, self.steps, self.exchange
        if not self._step_open:  # the first step of this process; later ones open as the one before closes
            run.algorithm.begin_round(step)
            self._step_open = True
        run.status("training")
        deadline = started + run.windows()[1]
        while not steps.full and (left := deadline - run.clock()) > 0:
            for device in steps.expired(run.clock(), run.windows()[1]):
                log.info("step %d: %s has trained for longer than the timeout; asked again", step, device)
            self._dispatch(step)
            run.serve_stale(min(1.0, left))
            if exchange.device_refusals and not steps.step.arrivals:  # only once a device refused
                exchange.stop_if_every_device_refused("train", step, run.trainers_online(), ())
        arrivals = steps.step.arrivals
        if arrivals:
            aggregating = run.clock()
            run.algorithm.close_round(step)
            run.events.emit(RoundAggregated(step, arrivals, run.clock() - aggregating))
        else:
            log.warning("step %d: no update arrived within %.0f s; global state unchanged", step, run.windows()[1])
        record = steps.close_step()
        run.algorithm.begin_round(step + 1)  # arrivals from now on, during the evaluation too, go to the next step
        replied, missing = tuple(self._step_replied), tuple(sorted(self._step_missing))
        self._step_replied, self._step_missing = [], set()
        outcome = "aborted" if not arrivals else ("complete" if arrivals >= steps.buffer else Outcome.DEADLINE.value)
        devices = RoundDevices(replied=replied, refused=dict(sorted(exchange.refusals.items())), missing=missing)
        return TrainedRound(record.dispatched, arrivals, outcome, arrivals, devices, step=record)

    def on_hello(self, client_id: str) -> None:
        """A device in flight that registers again gets its TRAIN again."""
        if (flight := self.steps.flights.get(client_id)) is not None:
            self.run.outbox.send(self.run.topics.down(client_id, Kind.TRAIN), resent(flight.request))

    def on_offline(self, client_id: str) -> None:
        if client_id in self.steps.flights:
            self.steps.lost(client_id)
            self._step_missing.add(client_id)

    def _dispatch(self, step: int) -> None:
        """Send the current state to the idle online trainers that may start now: one TRAIN, on
        each one's own topic, so that no device downloads a model it was not asked to train."""
        run, steps = self.run, self.steps
        devices = steps.to_dispatch(run.trainers_online())
        if not devices:
            return
        groups = run.algorithm.task_groups(step)
        run.algorithm.check_outgoing(f"the train of step {step}", groups)
        task = Envelope(Kind.TRAIN, COORDINATOR, run_id=run.run_id, round=step, groups=groups,
                        config={"selected": devices, "version": steps.version, **run.task_config(step, len(devices))})
        steps.dispatched(devices, task, run.clock())
        run.events.emit(RoundStarted(step, tuple(devices)))
        for device in devices:
            run.outbox.send(run.topics.down(device, Kind.TRAIN), task)

    def takes(self, received: Received) -> bool:
        """Every update under `mode async`: it must end the flight its device is on; too stale, it
        is refused (`too_stale`); else checked against what its version sent, rebased on the
        current state with its staleness weight and folded into the open step."""
        run, steps, exchange = self.run, self.steps, self.exchange
        envelope = received.envelope
        flight = steps.flight_of(envelope.sender, envelope.config.get("in_reply_to"))
        if flight is None:
            run.outbox.reject(envelope, Reason.STALE, f"update from {envelope.sender} answers no request it is "
                                                      "training on")
            return True
        if steps.version >= run.config.training.rounds:  # it was training when the last step closed
            steps.land(flight)
            run.late.discard(envelope.sender)
            log.info("update from %s arrived after the last aggregation step; discarded", envelope.sender)
            return True
        staleness, sent = steps.land(flight)
        if exchange.device_refused(envelope, None):
            return True
        if sent is None:
            exchange.refusals[envelope.sender] = Reason.TOO_STALE.value
            run.outbox.reject(envelope, Reason.TOO_STALE, f"update from {envelope.sender} of version "
                                                          f"{flight.version}, {staleness} behind (max_staleness "
                                                          f"{steps.max_staleness})")
            return True
        registered = run.registry.devices[envelope.sender].num_examples
        validating = run.clock()
        try:
            groups, weight = checked_update(run.algorithm, envelope.round, envelope, sent, registered, run.limits,
                                            UploadCodec.of(run.config.training))
        except ProtocolError as err:
            exchange.refusals[envelope.sender] = err.reason.value
            run.outbox.reject(envelope, err.reason, f"update from {envelope.sender}: {err.detail}")
            return True
        accumulating = run.clock()
        current = run.algorithm.task_groups(steps.version)
        run.algorithm.accumulate(envelope.sender, rebase(groups, sent, current,
                                                         staleness_factor(staleness, steps.exponent)),
                                 envelope.metrics, weight)
        steps.folded(staleness)
        self._step_replied.append(envelope.sender)
        now = run.clock()
        run.replied_after(now - flight.started)
        run.events.emit(UpdateAccepted(run.completed + 1, envelope.sender, received.size, now - flight.started,
                                       accumulating - validating, now - accumulating))
        return True

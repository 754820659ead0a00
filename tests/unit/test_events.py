"""The coordinator's event bus: callbacks get the events of the types they asked for, in order."""

from __future__ import annotations

import pytest

from coordinator.events import Event, EventBus, RoundAggregated, RoundStarted, UpdateAccepted


def test_callbacks_get_the_events_of_their_types_in_the_order_emitted() -> None:
    # Prepare
    bus = EventBus()
    everything: list = []
    rounds: list = []
    bus.subscribe(everything.append)
    bus.subscribe(rounds.append, RoundStarted, RoundAggregated)
    emitted: list[Event] = [RoundStarted(1, ("dev000",)), UpdateAccepted(1, "dev000", 120, 0.5, 0.01, 0.02),
                            RoundAggregated(1, 1, 0.03)]

    # Execute
    for event in emitted:
        bus.emit(event)

    # Assert
    assert everything == emitted
    assert rounds == [emitted[0], emitted[2]]


def test_subscribing_to_something_that_is_not_an_event_names_it() -> None:
    with pytest.raises(TypeError, match="dict"):
        EventBus().subscribe(print, RoundStarted, dict)

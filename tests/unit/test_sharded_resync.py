"""A shard aggregator that missed its round's ROSTER, and one of its devices' updates, recovers
within the round over the loopback broker: its broker stops delivering to it without closing
the connection (as a stalled NATS JetStream consumer does), the updates that still arrive wait
for a round that never opens, so it subscribes and registers again; the coordinator repeats the
ROSTER and the TRAIN to it and the TRAIN to the devices it has not heard from, whose kept
replies come again. The round aggregates every device, long before its timeout would end it."""

from __future__ import annotations

from loopback_runs import StallsAtItsFirstRoster


def test_an_aggregator_that_missed_its_roster_and_an_update_registers_again_and_the_round_completes(federation):
    # Prepare: one shard, three devices; the round waits for all three, for up to 60 s
    config = federation.config(clients=3, rounds=1, shards=1, min_clients=3, round_timeout=60.0, quorum_grace=60.0)
    federation.start_aggregator(0, 1, transport_type=StallsAtItsFirstRoster, resync_after=0.0)
    for index in range(3):
        federation.start_device(index, 3)
    coordinator = federation.coordinator(config)

    # Execute
    report = coordinator.run()

    # Assert: the round took all three updates through the shard, lost nothing
    (round_,) = report["rounds"]
    assert round_["outcome"] == "complete" and round_["participants"] == 3 and round_["missing"] == 0
    assert not round_.get("lost_shards")
    rejoined = [e for e in report["event_log"] if e["event"] == "rejoined" and e.get("device") == "aggregator-0"]
    assert len(rejoined) >= 1
    assert federation.devices_exit()

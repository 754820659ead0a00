"""Downlink codecs end to end over the loopback broker: a FedAvg run whose TRAINs carry the
change since the previous one completes close to full's accuracy in a half (fp16) or a quarter
(int8) of the TRAIN bytes; a device that lost the state asks for it by version (FETCH) and trains
on the full TRAIN sent on its own topic; a FETCH of another version is refused; the coordinator
holds what a device reconstructs, bit for bit."""

from __future__ import annotations

import pytest

from coordinator.events import RoundEnded
from edge_sdk import wire
from edge_sdk.downlink import HeldState
from edge_sdk.loopback import LoopbackTransport
from edge_sdk.protocol import Envelope, Kind
from loopback_runs import WAIT, LoopbackFederation, drain, listener

RESULTS: dict[str, tuple[float, dict[int, int]]] = {}  # codec -> (accuracy, TRAIN bytes by round)


def _device(federation: LoopbackFederation, index: int):
    """Trainer `index` of 3 (an EdgeClient, returned), running in a thread."""
    from edge_sdk.client import EdgeClient
    from edge_sdk.data import load_client_data

    client_id = f"dev{index:03d}"
    will = (federation.topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
    client = EdgeClient(client_id, load_client_data("digits", num_clients=3, index=index, seed=0),
                        federation=federation.topics.federation, state_dir=federation.state_dir(client_id),
                        device="cpu", compute_lock=federation.lock,
                        transport=LoopbackTransport(federation.broker, client_id, will=will))
    federation.run_device(client)
    return client


def _run(tmp_path_factory, codec: str) -> tuple[float, dict[int, int]]:
    """A 3-device, 3-round FedAvg run on digits with `codec`: its accuracy and TRAIN bytes by round."""
    if codec not in RESULTS:
        federation = LoopbackFederation(tmp_path_factory.mktemp(codec), f"fed-downlink-{codec}")
        try:
            trains = listener(federation.broker, "spy", f"{federation.topics.prefix}/down/all/train",
                              federation.topics)
            coordinator = federation.coordinator(federation.config(rounds=3, downlink_codec=codec))
            for index in range(3):
                federation.start_device(index, 3)
            report = coordinator.run()
            assert [r["outcome"] for r in report["rounds"]] == ["complete"] * 3
            assert report["rejections"] == {}
            sizes: dict[int, int] = {}
            while (received := trains.receive(timeout=0.0)) is not None:
                sizes[received.envelope.round] = sizes.get(received.envelope.round, 0) + received.size
            RESULTS[codec] = (report["final"]["personalized_accuracy"]["mean"], sizes)
        finally:
            federation.shutdown()
    return RESULTS[codec]


@pytest.mark.parametrize(("codec", "ratio"), [("fp16", 0.5), ("int8", 0.25)])
def test_a_lossy_downlink_completes_close_to_full_in_fewer_bytes(tmp_path_factory, quiet_torch, codec, ratio):
    # Execute
    full_accuracy, full_bytes = _run(tmp_path_factory, "full")
    accuracy, sizes = _run(tmp_path_factory, codec)

    # Assert: round 1 goes in full, later rounds in about `ratio` of the bytes, accuracy close to full's
    assert sorted(sizes) == [1, 2, 3]
    assert sizes[1] == pytest.approx(full_bytes[1], rel=0.01)
    for round_ in (2, 3):
        assert sizes[round_] / full_bytes[round_] == pytest.approx(ratio, abs=0.03), (sizes, full_bytes)
    assert accuracy >= full_accuracy - 0.03, (accuracy, full_accuracy)


def test_a_device_that_lost_the_state_fetches_it_and_the_coordinator_holds_what_devices_do(federation):
    # Prepare: dev002 forgets the state after round 1; dev000 sends a FETCH of a wrong version then
    topics = federation.topics
    fetches = federation.spy(Kind.FETCH)
    own = listener(federation.broker, "spy-own", f"{topics.prefix}/down/dev002/train", topics)
    nacks = listener(federation.broker, "spy-nack", f"{topics.prefix}/down/dev000/nack", topics)
    coordinator = federation.coordinator(federation.config(rounds=3, downlink_codec="int8"))
    devices = [_device(federation, index) for index in range(3)]
    forged = federation.broker.transport("forger")
    forged.connect()

    def after(event: RoundEnded) -> None:
        if event.round == 1:
            devices[2].held = HeldState()
            wrong = Envelope(Kind.FETCH, "dev000", run_id=coordinator.run_id, round=2,
                             config={"state": 7, "in_reply_to": "nothing"})
            forged.publish(topics.up("dev000", Kind.FETCH), wire.encode(wrong))

    coordinator.subscribe(after, RoundEnded)

    # Execute
    report = coordinator.run()

    # Assert: every round complete; dev002 asked for state 2 and got round 2's TRAIN in full
    assert [r["outcome"] for r in report["rounds"]] == ["complete"] * 3
    asked = [e for e in drain(fetches) if e.sender == "dev002"]
    assert [(e.round, e.config["state"]) for e in asked] == [(2, 2)]
    resent = drain(own)
    assert [(e.round, e.config["downlink"]) for e in resent] == [(2, {"codec": "full", "version": 2})]
    assert resent[0].msg_id == asked[0].config["in_reply_to"]
    assert not any(name.endswith("#scale") for name in resent[0].groups["shared"])
    refused = drain(nacks)
    assert [(n.config["refused_kind"], n.config["reason"]) for n in refused] == [("fetch", "stale")]
    # the coordinator holds, bit for bit, what every device reconstructed from round 3's TRAIN
    held = coordinator.exchange.downlink.held
    assert held is not None and coordinator.exchange.downlink.version == 3
    for device in devices:
        assert device.held.version == 3
        for name, array in held["shared"].items():
            assert device.held.groups["shared"][name].tobytes() == array.tobytes(), (device.client_id, name)
    assert federation.devices_exit(WAIT)

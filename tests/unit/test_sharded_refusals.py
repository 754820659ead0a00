"""A sharded run refuses a reply as an unsharded one does, over the loopback broker (every message
encoded, routed by topic and decoded as over MQTT): a device's update that names no request is
its answer, refused by its shard aggregator; the aggregator's NOTE names it, so the coordinator
stops waiting for the device, counts the refusal and NACKs the device. And the coordinator reads
the refusals of an aggregator whose NOTE entries carry no msg_id (counted, no NACK)."""

from __future__ import annotations

import threading
from pathlib import Path


from coordinator.config.run_config import RunConfig
from coordinator.run.folder import RunFolder
from coordinator.shards.aggregator import ShardAggregator
from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.loopback import LoopbackBroker
from edge_sdk.protocol import Envelope, Kind, Topics
from loopback_runs import drain, listener

WAIT = 20.0
FED = "shardrefusals"


class OldDocClient(EdgeClient):
    """A trainer whose replies name no request (no `in_reply_to`)."""

    def send(self, kind: Kind, round_: int = 0, *, request: Envelope | None = None, **fields) -> None:
        super().send(kind, round_, **fields)


class OlderAggregator(ShardAggregator):
    """An aggregator from before refused updates were named: its NOTE entries have 3 elements."""

    def send(self, kind: Kind, round_: int = 0, **fields) -> None:
        if kind is Kind.NOTE:
            config = fields["config"]
            fields["config"] = {**config, "refused": [entry[:3] for entry in config["refused"]]}
        super().send(kind, round_, **fields)


def _sharded_run(tmp_path: Path, aggregator_cls: type[ShardAggregator]) -> tuple[dict, RunConfig, list[Envelope],
                                                                                 list[Envelope]]:
    """One round of three trainers and one shard aggregator (`aggregator_cls`); dev002 names no
    request in its replies. The round's grace and timeout are 60 s: a round that waited for
    dev002 would last a minute. Returns the report, the config, dev002's TRAIN_RES and the
    NACKs the coordinator sent."""
    from coordinator.server import Coordinator

    topics, broker, stop, lock = Topics(FED), LoopbackBroker(), threading.Event(), threading.Lock()
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=3, rounds=1, local_epochs=1, batch_size=64,
                          seed=0, federation=FED, out=str(tmp_path / "run"), min_clients=2, round_timeout=60.0,
                          quorum_grace=60.0, registration_timeout=30.0, device="cpu", shards=1)
    nacks = listener(broker, "spy-nacks", topics.down("+", Kind.NACK), topics)
    updates = listener(broker, "spy-updates", topics.shard(0, "dev002", Kind.TRAIN_RES), topics)
    runners: list[EdgeClient | ShardAggregator] = []
    for index, cls in enumerate([EdgeClient, EdgeClient, OldDocClient]):
        client_id = f"dev{index:03d}"
        will = (topics.up(client_id, Kind.OFFLINE), wire.encode(Envelope(Kind.OFFLINE, client_id)))
        runners.append(cls(client_id, load_client_data("digits", num_clients=3, index=index, seed=0),
                           federation=FED, state_dir=RunFolder(tmp_path / "run").device_state(client_id),
                           device="cpu", compute_lock=lock, transport=broker.transport(client_id, will=will)))
    runners.append(aggregator_cls(0, 1, federation=FED, transport=broker.transport("aggregator-0")))
    threads = [threading.Thread(target=runner.run, args=(stop,), daemon=True) for runner in runners]
    coordinator_transport = broker.transport("coordinator")
    coordinator_transport.connect()
    coordinator = Coordinator(config, Channel(coordinator_transport, topics))
    for thread in threads:
        thread.start()
    try:
        report = coordinator.run()
        for thread in threads:
            thread.join(WAIT)
    finally:
        stop.set()
    assert not any(t.is_alive() for t in threads), "a device or the aggregator did not exit"
    return report, config, drain(updates), drain(nacks)


def test_an_update_naming_no_request_ends_its_devices_wait_and_the_device_is_nacked(tmp_path, quiet_torch):
    # Execute
    report, config, (update,), sent = _sharded_run(tmp_path, ShardAggregator)

    # Assert: the round ended when dev002 had answered, with dev002 refused, not late
    (record,) = report["rounds"]
    assert (record["outcome"], record["participants"], record["refused"], record["late"]) == ("complete", 2, 1, 0)
    assert record["seconds"] < config.round.quorum_grace and record["lost_shards"] == []
    assert report["rejections"] == {"stale": 2}, "its TRAIN_RES (noted by the aggregator) and its EVAL_RES"
    # ... and dev002 got a NACK naming its update, as unsharded, then one for its evaluation
    assert "in_reply_to" not in update.config
    assert [n.config for n in sent if n.config["refused_kind"] == "train_res"] == [
        {"in_reply_to": update.msg_id, "refused_kind": "train_res", "reason": "stale"}]
    assert {n.config["refused_kind"] for n in sent} == {"train_res", "eval_res"}
    assert all(n.kind is Kind.NACK for n in sent)


def test_an_older_aggregators_unnamed_refusal_still_ends_the_devices_wait_without_a_nack(tmp_path, quiet_torch):
    # Execute
    report, config, _, sent = _sharded_run(tmp_path, OlderAggregator)

    # Assert
    (record,) = report["rounds"]
    assert (record["outcome"], record["participants"], record["refused"], record["late"]) == ("complete", 2, 1, 0)
    assert record["seconds"] < config.round.quorum_grace
    assert report["rejections"] == {"stale": 2}
    assert [n.config["refused_kind"] for n in sent] == ["eval_res"]

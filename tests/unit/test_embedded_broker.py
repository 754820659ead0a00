"""The embedded amqtt broker's subscription table tolerates changes while it is iterated."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.brokers.embedded import SnapshotDict, make_broker


def test_snapshot_dict_iterates_while_another_task_subscribes() -> None:
    # Prepare: what amqtt does, an `await` inside a loop over the table
    table = SnapshotDict({"a/+": [1], "b/+": [2]})
    seen_keys, seen_items = [], []

    async def walk() -> None:
        for topic in table:
            seen_keys.append(topic)
            await asyncio.sleep(0)
        for topic, subscribers in table.items():
            seen_items.append((topic, subscribers))
            await asyncio.sleep(0)

    async def subscribe() -> None:
        for i in range(4):
            table[f"c{i}/+"] = [i]
            await asyncio.sleep(0)

    async def main() -> None:
        await asyncio.gather(walk(), subscribe())

    # Execute (a plain dict raises "dictionary changed size during iteration" here)
    asyncio.run(main())

    # Assert: the walk saw a consistent snapshot, the table has every subscription
    assert seen_keys[:2] == ["a/+", "b/+"]
    assert len(seen_items) >= 2 and len(table) == 6
    with pytest.raises(RuntimeError, match="changed size"):
        asyncio.run(_walk_plain_dict())


async def _walk_plain_dict() -> None:
    table = {"a/+": [1], "b/+": [2]}

    async def subscribe() -> None:
        table["c/+"] = [3]

    for _ in table:
        await subscribe()


def test_the_broker_uses_the_snapshot_table() -> None:
    config = {"listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:0"}}}

    async def build():
        return make_broker(config)

    broker = asyncio.run(build())

    assert isinstance(broker._subscriptions, SnapshotDict)


@pytest.fixture
def taken_port():
    """A loopback port some other socket listens on."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_given_port_that_is_taken_fails_at_once_saying_why(taken_port) -> None:
    from coordinator.brokers.embedded import EmbeddedBroker

    broker = EmbeddedBroker(port=taken_port, start_timeout=60.0)

    with pytest.raises(RuntimeError, match=f"did not start on mqtt://127.0.0.1:{taken_port}: .*address already in use"):
        broker.start()  # told by the broker process, not by the 60 s timeout


def test_a_picked_port_taken_before_the_broker_binds_it_is_replaced(taken_port, monkeypatch) -> None:
    from coordinator.brokers import embedded as module

    picks = iter([taken_port])
    real_free_port = module.free_port
    monkeypatch.setattr(module, "free_port", lambda host="127.0.0.1": next(picks, None) or real_free_port(host))

    with module.EmbeddedBroker() as broker:
        assert broker.port != taken_port
        assert module.wait_for_port("127.0.0.1", broker.port, timeout=5.0)

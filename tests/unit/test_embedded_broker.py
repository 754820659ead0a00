"""The embedded amqtt broker's subscription table tolerates changes while it is iterated."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.broker import SnapshotDict, make_broker


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

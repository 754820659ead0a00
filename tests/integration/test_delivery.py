"""Duplicated, reordered and late deliveries change nothing (real Mosquitto, in-process sides).

A spy connection re-publishes every chunk frame a device sends, in reverse order, and sends
round-1 replies again as new messages during round 2. The final global state must equal that of an undisturbed run.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import replace

import numpy as np
import pytest

from coordinator.config.run_config import RunConfig
from coordinator.run.folder import RunFolder
from coordinator.server import Coordinator
from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.chunks import chunk_from_dict
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.protocol import Envelope, Topics, new_message_id
from edge_sdk.transport import MqttSettings, MqttTransport
from saved_runs import checkpoint_at

pytestmark = pytest.mark.integration
CHUNK = 128 << 10


class Replayer:
    """Re-publishes every complete chunked TRAIN_RES reversed (duplicates, out of order), and can
    send round-1 replies again later as new messages, as a slow device would."""

    def __init__(self, url: str, federation: str):
        self.transport = MqttTransport(f"{federation}.spy", MqttSettings(url=url))
        self.transport.connect()
        self.transport.subscribe(f"edgepfl/{federation}/up/+/train_res")
        self.channel = Channel(self.transport, Topics(federation), chunk_size=CHUNK)
        self.blobs: dict[str, dict[int, bytes]] = {}
        self.first_round: list[tuple[str, Envelope]] = []
        self.replayed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        done: set[str] = set()
        while not self._stop.is_set():
            try:
                topic, payload = self.transport.incoming.get(timeout=0.2)
            except queue.Empty:
                continue
            chunk = chunk_from_dict(wire.unpack(payload))
            if chunk.blob_id in done:
                continue  # our own re-publication coming back
            parts = self.blobs.setdefault(chunk.blob_id, {})
            parts[chunk.index] = payload
            if len(parts) < chunk.count:
                continue
            done.add(chunk.blob_id)
            for index in reversed(range(chunk.count)):
                self.transport.publish(topic, parts[index])
                self.replayed += 1
            data = b"".join(chunk_from_dict(wire.unpack(parts[i])).data for i in range(chunk.count))
            envelope = wire.decode(data)
            if envelope.round == 1:
                self.first_round.append((topic, envelope))

    def send_first_round_again(self) -> None:
        """The same replies as new messages (new ids) while round 2 runs: they must be stale."""
        for topic, envelope in self.first_round:
            self.channel.send(topic, replace(envelope, msg_id=new_message_id()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.transport.close()


def run(url: str, out, federation: str, *, disturb: bool):
    # float64 sums: the mean does not depend on the order the three replies arrive in, so the
    # two runs can be compared bit for bit (float32 sums differ in the last bit, and training
    # in round 2 amplifies that)
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=3, rounds=2, local_epochs=1, out=str(out),
                          federation=federation, round_timeout=60, chunk_size=CHUNK, aggregation_dtype="float64")
    settings = MqttSettings(url=url)
    threads = []
    for index in range(3):
        client = EdgeClient(f"dev{index}", load_client_data("digits", num_clients=3, index=index, seed=0),
                            broker=settings, federation=federation, state_dir=out / f"dev{index}", chunk_size=CHUNK,
                            compute_lock=LOCK)
        thread = threading.Thread(target=client.run, daemon=True)
        thread.start()
        threads.append(thread)
    spy = Replayer(url, federation) if disturb else None
    transport = MqttTransport(f"{federation}.coordinator", settings)
    transport.connect()
    on_round = (lambda record: spy.send_first_round_again() if record["round"] == 1 else None) if spy else None
    try:
        report = Coordinator(config, Channel(transport, Topics(federation), chunk_size=CHUNK),
                             on_round=on_round).run()
    finally:
        transport.close()
        if spy:
            spy.close()
        for thread in threads:
            thread.join(timeout=30)
    return report, checkpoint_at(RunFolder(out).checkpoint).state, spy


LOCK = threading.Lock()  # one device trains at a time: the same arithmetic in both runs


def test_duplicated_reordered_and_late_replies_change_nothing(mosquitto, tmp_path):
    clean_report, clean_state, _ = run(mosquitto.url, tmp_path / "clean", "clean", disturb=False)

    report, state, spy = run(mosquitto.url, tmp_path / "disturbed", "disturbed", disturb=True)

    assert spy.replayed >= 30, "every reply of both rounds was delivered twice"
    assert [r["participants"] for r in report["rounds"]] == [3, 3]
    assert report["rejections"].get("stale", 0) >= 3, "round-1 replies replayed in round 2 are stale"
    for key, value in clean_state["shared"].items():
        np.testing.assert_allclose(state["shared"][key], value, rtol=0, atol=1e-6)
    assert clean_report["rejections"] == {}

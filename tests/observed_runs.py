"""The fleet the operating tests watch: three trainer threads over a real broker, dev2 uploading
NaN every round (so every round has a refusal to show), and the coordinator's connection."""

from __future__ import annotations

import threading
from pathlib import Path

from edge_sdk.transport import MqttSettings, MqttTransport


def nan_fleet(url: str, federation: str, tmp_path: Path) -> tuple[list[threading.Thread], threading.Event,
                                                                    MqttTransport]:
    """(device threads, not started; the event that stops them; the coordinator's connected transport)."""
    from edge_sdk.client import EdgeClient
    from edge_sdk.data import load_client_data

    settings = MqttSettings(url=url)
    stop = threading.Event()
    threads = []
    for index in range(3):
        data = load_client_data("digits", num_clients=3, index=index, seed=0)
        client = EdgeClient(f"dev{index}", data, broker=settings, federation=federation,
                            state_dir=tmp_path / f"dev{index}", attack="nan" if index == 2 else None)
        threads.append(threading.Thread(target=client.run, args=(stop,), daemon=True))
    transport = MqttTransport(f"{federation}.coordinator", settings)
    transport.connect()
    return threads, stop, transport

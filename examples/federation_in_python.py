"""A federation wired by hand from Python: a broker, a coordinator and trainer devices in one process.

`edgepfl simulate` does the same with worker processes; here every piece is an object you could
place elsewhere: the coordinator on a server, each `EdgeClient` on its own device with its own
data and MQTT connection. `on_round` sees each round's record as the coordinator closes it
(a place for your own logging or early stopping).

    python examples/federation_in_python.py --algorithm fedper --devices 4 --rounds 3

Uses scikit-learn's bundled digits (no download) and the embedded amqtt broker; pass
`--broker mqtt://127.0.0.1:1883` to use a running Mosquitto instead.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from pathlib import Path

from coordinator.brokers.embedded import EmbeddedBroker
from coordinator.config.run_config import RunConfig
from coordinator.server import Coordinator
from edge_sdk.client import EdgeClient
from edge_sdk.data import load_client_data
from edge_sdk.transport import MqttSettings


def show(record: dict) -> None:
    accuracy = record["personalized_accuracy"]
    print(f"round {record['round']}: {record['participants']} devices replied, "
          f"mean personalized accuracy {accuracy['mean']:.3f}, {record['bytes_up'] / 1e6:.2f} MB up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="fedper")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", help="mqtt://host:port of a running broker (default: start amqtt here)")
    args = parser.parse_args()

    embedded = None if args.broker else EmbeddedBroker().start()
    url = args.broker or embedded.url
    protocol = "3.1.1" if embedded else "auto"  # amqtt speaks MQTT 3.1.1 only
    try:
        with tempfile.TemporaryDirectory() as out:
            config = RunConfig.of(algorithm=args.algorithm, dataset="digits", clients=args.devices, rounds=args.rounds,
                                  partition="dirichlet", alpha=0.5, federation="example", out=out,
                                  mqtt_protocol=protocol, min_clients=args.devices, quorum_grace=0.0)
            devices = [
                EdgeClient(f"dev{i}", load_client_data("digits", num_clients=args.devices, index=i,
                                                       partition="dirichlet", alpha=0.5, seed=0),
                           broker=MqttSettings(url, protocol=protocol), federation="example",
                           state_dir=Path(out) / "state" / f"dev{i}")
                for i in range(args.devices)
            ]
            threads = [threading.Thread(target=device.run, daemon=True) for device in devices]
            for thread in threads:
                thread.start()
            transport = config.coordinator_transport(url)
            transport.connect()
            try:
                report = Coordinator(config, config.coordinator_channel(transport), on_round=show).run()
            finally:
                transport.close()
            for thread in threads:
                thread.join(timeout=30)
            final = report["final"]["personalized_accuracy"]
            print(f"{args.algorithm}: final mean personalized accuracy {final['mean']:.3f} (min {final['min']:.3f}) "
                  f"over {len(report['final']['per_client'])} devices")
    finally:
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()

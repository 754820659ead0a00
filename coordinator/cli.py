"""The `edgepfl` command: simulate, coordinator, client, broker, broker-config.

Heavy imports (torch, amqtt) happen inside the subcommands, so `edgepfl --help` is instant and
a device only imports what its subcommand needs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

def bool_flag(value: str) -> bool:
    """`--flag`, `--flag true` or `--flag false`."""
    if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() in ("true", "1", "yes")


RUN_FLAGS: list[tuple[str, type, str]] = [
    ("--algorithm", str, "algorithm id (fedavg, ...)"),
    ("--dataset", str, "digits | fmnist | mnist | cifar10 | cifar100"),
    ("--data-dir", str, "where dataset files are (default: system locations, then a download)"),
    ("--partition", str, "iid | dirichlet | shards | domains"),
    ("--alpha", float, "Dirichlet concentration (partition=dirichlet)"),
    ("--classes-per-client", int, "classes per device (partition=shards)"),
    ("--clients", int, "number of devices"),
    ("--fraction", float, "fraction of devices selected per round"),
    ("--rounds", int, "federated rounds"),
    ("--local-epochs", int, "local epochs per round"),
    ("--batch-size", int, "local batch size"),
    ("--lr", float, "local learning rate"),
    ("--model", str, "auto | cnn8 | cnn8_wide | cnn28 | cnn32 | resnet18 | mobilenet_v3_small"),
    ("--seed", int, "the run's seed (selection, partition, initialization)"),
    ("--broker", str, "mqtt://host:port of an existing broker (simulate: default embedded amqtt)"),
    ("--federation", str, "federation name (topic namespace)"),
    ("--eval-every", int, "evaluate every N rounds (and after the last)"),
    ("--round-timeout", float, "seconds before a round closes with the replies it has"),
    ("--min-clients", int, "quorum: replies needed to aggregate a round"),
    ("--holdout-clients", int, "devices never selected for training (they only personalize at evaluation)"),
    ("--quorum-grace", float, "seconds to wait for stragglers once the quorum replied"),
    ("--registration-timeout", float, "seconds to wait for --clients devices to register"),
    ("--chunk-size", int, "largest message the coordinator publishes whole, in bytes (default 1 MiB); larger "
                          "ones are chunked"),
    ("--upload-chunk-size", int, "simulate: the same for the devices' uploads (default 64 MiB: an update is one "
                                 "message)"),
    ("--flow-control-bytes", int, "the coordinator stops reading from the broker while it holds this many bytes of "
                                  "received messages (default 1 MiB; 0: off)"),
    ("--device", str, "auto | cpu | cuda | cuda:N | mps (simulated devices)"),
    ("--aggregation", str, "mean | median | trimmed_mean (robust rules hold every update of a round)"),
    ("--trim-fraction", float, "share of the largest and of the smallest values dropped by trimmed_mean"),
    ("--clip-norm", float, "clip each update's change to this L2 norm before aggregating (0: off)"),
    ("--aggregation-dtype", str, "float32 | float64: what the mean sums updates in (float64: one more model of "
                                 "memory; runs then repeat bit for bit whatever order updates arrive in)"),
    ("--lite-fraction", float, "simulate: this share of the devices are weak ones (ONNX Runtime + a numpy head)"),
    ("--head", str, "svm | lr | mlp | ncm: the weak devices' personal head"),
    ("--release", bool_flag, "export and publish the global body after training (RepPer always does; algorithms "
                             "that keep BatchNorm statistics personal pool the global body's from the trainers)"),
    ("--adversaries", int, "simulate: this many devices corrupt their uploads (robustness experiments)"),
    ("--attack", str, "sign_flip | noise | nan | mixed (what the adversaries do)"),
    ("--upload-codec", str, "fp32 | fp16 | int8: how devices encode their uploads (changes from the broadcast)"),
    ("--amp", bool_flag, "automatic mixed precision on CUDA devices"),
    ("--max-update-norm", float, "reject updates that move the shared state further than this (0: off)"),
    ("--grad-clip-norm", float, "devices clip each local step's gradients to this L2 norm (0: off)"),
    ("--mqtt-protocol", str, "auto | 5 | 3.1.1"),
    ("--username", str, "MQTT username"),
    ("--password", str, "MQTT password"),
    ("--ca-file", str, "CA certificate for TLS (mqtts://)"),
    ("--cert-file", str, "client certificate for mutual TLS"),
    ("--key-file", str, "client key for mutual TLS"),
    ("--credentials", str, "credentials.json from `edgepfl broker-config` (coordinator and device accounts)"),
    ("--out", str, "output folder (report.json, metrics.jsonl, curves.png, checkpoint)"),
]


def _add_run_flags(parser: argparse.ArgumentParser, *, workers: bool) -> None:
    parser.add_argument("--config", help="TOML file with the same keys as these flags")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="algorithm hyperparameter (repeatable)")
    for flag, kind, text in RUN_FLAGS:
        if kind is bool_flag:
            parser.add_argument(flag, type=kind, nargs="?", const=True, default=None, help=text)
        else:
            parser.add_argument(flag, type=kind, default=None, help=text)
    if workers:
        parser.add_argument("--workers", type=int, default=None, help="device worker processes (default: cores)")


def _run_config(args: argparse.Namespace):
    from edge_sdk.config import parse_assignments

    from .config import build_config

    overrides: dict[str, Any] = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in RUN_FLAGS
    }
    overrides["workers"] = getattr(args, "workers", None)
    return build_config(args.config, overrides, parse_assignments(args.set))


def _summary(report: dict[str, Any], out: str) -> str:
    final = report["final"]["personalized_accuracy"]
    comm = report["communication"]
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    lines = [
        f"algorithm {report['algorithm']} on {report['dataset']} ({report['partition']}, {report['clients']} devices, "
        f"model {report['model']})",
        f"rounds completed       {report['rounds_completed']}",
        f"personalized accuracy  mean {fmt(final['mean'])}  std {fmt(final['std'])}  min {fmt(final['min'])}  "
        f"best mean {fmt(final['best_mean'])}",
        f"global-model accuracy  {fmt(report['final']['global_accuracy'])}",
        f"communication          {comm['bytes_up'] / 1e6:.2f} MB up, {comm['bytes_down'] / 1e6:.2f} MB down",
        f"wall time              {report['wall_seconds']:.1f} s",
        f"rejected messages      {sum(report['rejections'].values())}",
        f"outputs                {out}/report.json, {out}/metrics.jsonl, {out}/curves.png",
    ]
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .memory import return_freed_buffers
    from .simulate import run_simulation

    config = _run_config(args)
    return_freed_buffers()  # the coordinator runs in this process
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=config.rounds, desc=f"{config.algorithm}", unit="round")
    traffic = [0]

    def on_round(record: dict[str, Any]) -> None:
        traffic[0] += record["bytes_up"] + record["bytes_down"]
        if bar is not None:
            acc = (record["personalized_accuracy"] or {}).get("mean")
            bar.set_postfix(round=record["round"], acc="-" if acc is None else f"{acc:.3f}", MB=f"{traffic[0] / 1e6:.1f}")
            bar.update(1)

    report = run_simulation(config, on_round=on_round)
    if bar is not None:
        bar.close()
    print(_summary(report, config.out))
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    from .memory import return_freed_buffers
    from .server import Coordinator

    config = _run_config(args)
    return_freed_buffers()
    transport = config.coordinator_transport(config.broker or "mqtt://127.0.0.1:1883")
    transport.connect()
    try:
        report = Coordinator(config, config.coordinator_channel(transport)).run()
    finally:
        transport.close()
    print(_summary(report, config.out))
    return 0


def cmd_client(args: argparse.Namespace) -> int:
    from edge_sdk.client import EdgeClient

    upload = {"chunk_size": args.chunk_size} if args.chunk_size else {}
    client = EdgeClient(args.client_id, _device_data(args), broker=_mqtt_settings(args), federation=args.federation,
                        amp=args.amp, **upload,
                        state_dir=args.state_dir or f"edgepfl-state/{args.client_id}", device=args.device)
    client.run()
    return 0


def _device_data(args: argparse.Namespace):
    """A device's own data (--data) or its partition of a known dataset (--index)."""
    from edge_sdk.data import load_client_data, load_folder_data

    if args.data:
        return load_folder_data(args.data, args.dataset, seed=args.seed)
    if args.index is None:
        raise SystemExit(f"edgepfl {args.command}: give --index (a partition of --dataset) or --data (your own data)")
    return load_client_data(args.dataset, num_clients=args.clients, index=args.index, partition=args.partition,
                            seed=args.seed, alpha=args.alpha, classes_per_client=args.classes_per_client,
                            data_dir=args.data_dir)


def _mqtt_settings(args: argparse.Namespace):
    from edge_sdk.transport import MqttSettings

    return MqttSettings(url=args.broker, username=args.username, password=args.password, ca_file=args.ca_file,
                        cert_file=args.cert_file, key_file=args.key_file, protocol=args.protocol)


def cmd_lite_client(args: argparse.Namespace) -> int:
    from edge_sdk.lite import LiteClient

    providers = args.providers if args.providers == "auto" else args.providers.split(",")
    client = LiteClient(args.client_id, _device_data(args), head=args.head, providers=providers,
                        share_prototypes=not args.no_prototypes, broker=_mqtt_settings(args),
                        federation=args.federation, state_dir=args.state_dir or f"edgepfl-state/{args.client_id}")
    client.run()
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import json

    from .export_command import export_run

    summary = export_run(args.run, args.out, part=args.part, quantize=args.quantize, also_fp32=args.also_fp32,
                         fp16=args.fp16, calibration_size=args.calibration_size, data_dir=args.data_dir)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from .broker import _serve

    print(f"amqtt broker on mqtt://{args.host}:{args.port} (Ctrl-C to stop)")
    _serve(args.host, args.port)
    return 0


def cmd_broker_config(args: argparse.Namespace) -> int:
    from .broker_config import describe, generate

    port = args.port if args.port is not None else (8883 if args.tls else 1883)
    setup = generate(args.out, args.federation, args.devices, port, host=args.host, tls=args.tls, sans=args.san,
                     user=args.user, force=args.force)
    print(describe(setup))
    return 0


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--username", help="MQTT username")
    parser.add_argument("--password", help="MQTT password")
    parser.add_argument("--ca-file", help="CA certificate for TLS (mqtts://)")
    parser.add_argument("--cert-file", help="client certificate for mutual TLS")
    parser.add_argument("--key-file", help="client key for mutual TLS")
    parser.add_argument("--protocol", default="auto", help="MQTT version: auto | 5 | 3.1.1")


def _add_device_flags(parser: argparse.ArgumentParser) -> None:
    """What every device command takes: where the broker is, who it is, where its data is."""
    parser.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    parser.add_argument("--federation", default="default")
    parser.add_argument("--client-id", required=True)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-dir")
    parser.add_argument("--data", help="this device's own data: an .npz with x, y or an ImageFolder directory")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--classes-per-client", type=int, default=2)
    parser.add_argument("--clients", type=int, default=10, help="number of partitions of --dataset")
    parser.add_argument("--index", type=int, help="which partition of --dataset is this device's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-dir", help="where personal state is kept (default edgepfl-state/<client-id>)")
    _add_connection_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgepfl", description="Personalized federated learning over MQTT")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    simulate = sub.add_parser("simulate", help="a whole federation on this machine over MQTT")
    _add_run_flags(simulate, workers=True)
    simulate.add_argument("--quiet", action="store_true", help="no progress bar")
    simulate.set_defaults(handler=cmd_simulate)

    coordinator = sub.add_parser("coordinator", help="run the coordinator against a broker")
    _add_run_flags(coordinator, workers=False)
    coordinator.set_defaults(handler=cmd_coordinator)

    client = sub.add_parser("client", help="run one trainer device")
    _add_device_flags(client)
    client.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    client.add_argument("--amp", action="store_true", help="automatic mixed precision on CUDA")
    client.add_argument("--chunk-size", type=int,
                        help="largest upload published as one message, in bytes (default 64 MiB; lower it for a "
                             "broker whose packet limit is smaller and that does not announce it over MQTT 5)")
    client.set_defaults(handler=cmd_client)

    lite = sub.add_parser("lite-client", help="run one weak device (ONNX Runtime + a numpy head, no torch)")
    _add_device_flags(lite)
    lite.add_argument("--head", default="svm", choices=["svm", "lr", "mlp", "ncm"], help="the personal head")
    lite.add_argument("--providers", default="auto", help="ONNX Runtime providers, comma-separated, or auto")
    lite.add_argument("--no-prototypes", action="store_true", help="do not report class counts and means")
    lite.set_defaults(handler=cmd_lite_client)

    export = sub.add_parser("export", help="export a run's frozen representation to ONNX (checked against PyTorch)")
    export.add_argument("--run", required=True, help="the run's --out folder (its checkpoint is exported)")
    export.add_argument("--out", required=True, help="the ONNX file to write, in the precision asked for (fp32, "
                                                     "--fp16, or --quantize int8)")
    export.add_argument("--part", default="body", help="which part to export (body)")
    export.add_argument("--quantize", choices=["int8"], help="write a static int8 QDQ model (per channel) at --out")
    export.add_argument("--also-fp32", action="store_true",
                        help="with --quantize int8: keep the fp32 model too, as <stem>.fp32.onnx beside --out")
    export.add_argument("--fp16", action="store_true", help="store the weights in float16")
    export.add_argument("--calibration-size", type=int, default=256, help="real images for calibration and checks")
    export.add_argument("--data-dir", help="where the run's dataset is (default: as the run had it)")
    export.set_defaults(handler=cmd_export)

    broker = sub.add_parser("broker", help="run the embedded amqtt broker in the foreground")
    broker.add_argument("--host", default="127.0.0.1")
    broker.add_argument("--port", type=int, default=1883)
    broker.set_defaults(handler=cmd_broker)

    broker_config = sub.add_parser("broker-config", help="write a Mosquitto setup: accounts, ACLs, mutual TLS")
    broker_config.add_argument("--out", required=True, help="folder for mosquitto.conf, passwords, acl, credentials")
    broker_config.add_argument("--federation", required=True, help="federation name (topic namespace)")
    broker_config.add_argument("--devices", required=True, help="comma-separated device ids (their MQTT usernames)")
    broker_config.add_argument("--port", type=int, help="listener port (default 1883, 8883 with --tls)")
    broker_config.add_argument("--host", default="127.0.0.1", help="address the listener binds (0.0.0.0: all)")
    broker_config.add_argument("--tls", action="store_true", help="mutual TLS: a CA, server and client certificates")
    broker_config.add_argument("--san", action="append", default=[], metavar="NAME",
                               help="extra DNS name or IP for the server certificate (repeatable)")
    broker_config.add_argument("--user", help="account mosquitto runs as when started as root (default: you)")
    broker_config.add_argument("--force", action="store_true", help="replace an existing setup (new passwords)")
    broker_config.set_defaults(handler=cmd_broker_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from edge_sdk.config import ConfigError
    from edge_sdk.data import DatasetNotFoundError

    try:
        return args.handler(args)
    except (ConfigError, DatasetNotFoundError, ValueError, FileNotFoundError) as exc:
        print(f"edgepfl {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `edgepfl` command: simulate, workers, coordinator, client, aggregator, view, broker, broker-config.

Heavy imports (torch, amqtt) happen inside the subcommands, after the arguments are checked, so
`edgepfl --help` and a refused flag are instant and a device only imports what its subcommand
needs. Every failure the user can act on ends in one line naming its cause and fix, with exit
code 2 for usage errors (a bad flag, a missing file, an `--out` holding another run) and 1 for
runtime failures (the broker unreachable or refusing, every device gone); Ctrl-C ends with one
line and 130, SIGTERM (`systemctl stop`, `docker stop`, Kubernetes) the same way with 143: both
unwind the command, so `simulate` stops its worker processes and embedded broker instead of
leaving them behind, whether the signal reaches the command alone or its whole process group.
A command started in the background by a non-interactive shell (`edgepfl simulate ... &` in a
script) inherits SIGINT ignored, as POSIX has it, and keeps ignoring it: stop it with SIGTERM.
A command run without its extra (PyTorch, scikit-learn for a built-in dataset, amqtt, ...) ends
in one line naming what to install, exit code 2 (`coordinator.extras`).
`-vv` logs the traceback of a failure too.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading
from typing import Any

from .commands.audit_privacy import add_audit_parser
from .commands.conformance import add_conformance_parser
from .config.flags import add_setting_flags, given, section_from
from .releases.command import add_release_parser
from .run.report_files import summary

log = logging.getLogger(__name__)
USAGE_ERROR, RUNTIME_FAILURE, INTERRUPTED, TERMINATED = 2, 1, 130, 143


class CommandFailed(RuntimeError):
    """A run that could not go on, for a reason the message states (exit code 1)."""


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread like KeyboardInterrupt (and, like it, not an
    Exception, so no `except Exception` on the way swallows it) to unwind the command."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _unwind_on_sigterm() -> None:
    """SIGTERM raises `Terminated` in the main thread, unless it is ignored (a supervisor's choice)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)


def _add_run_flags(parser: argparse.ArgumentParser, command: str, leave_out: tuple[str, ...] = ()) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file: the flags' keys, flat or in [section] tables (flags override it; "
                             "default: none)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="algorithm hyperparameter, e.g. --set mu=0.1 (repeatable; default: the algorithm's)")
    parser.set_defaults(setting_keys=add_setting_flags(parser, command, leave_out=leave_out))


def _run_config(args: argparse.Namespace):
    """The run's configuration from the flags and `--config`, every setting and hyperparameter
    checked, without importing torch."""
    from edge_sdk.config import ConfigError, parse_assignments

    from .algorithms import hyperparameters
    from .config.run_config import build_config

    config = build_config(args.config, given(args, args.setting_keys), parse_assignments(args.set))
    try:
        hyperparameters(config.run.algorithm, config.hyper)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return config


def _check_sharding(config) -> None:
    """Refuse a run with `shards` whose algorithm or aggregation rule cannot be split (imports the algorithm)."""
    from .algorithms import load
    from .shards.sharding import check_shardable

    check_shardable(load(config.run.algorithm), config.aggregation.rule, config.round.shards)


def cmd_simulate(args: argparse.Namespace) -> int:
    config = _run_config(args)  # refused before the heavy imports below
    local = None
    if args.local_devices is not None:
        from .hosting.device_ranges import parse_devices

        local = parse_devices(args.local_devices, config.run.clients, "--local-devices", allow_none=True)
    from .events import RunStarted
    from .hosting.simulate import run_simulation
    from .hosting.worker_watch import WorkersFailed
    from .memory import return_freed_buffers
    from .observe.session import observing
    from .run.report_files import cumulative_megabytes
    from .server import RegistrationTimeout, finished_report

    _check_sharding(config)
    finished = finished_report(config)
    if finished is not None:
        print(f"run {finished['run_id']} in {config.run.out} already finished all {config.training.rounds} rounds; "
              "nothing changed (raise --rounds to extend it)")
        print(summary(finished, config.run.out))
        return 0
    return_freed_buffers()  # the coordinator runs in this process
    bars: list = []
    traffic = [0]
    observers: list = []  # what --http and --track turn on

    def on_start(event: RunStarted) -> None:
        traffic[0] = event.bytes_so_far
        if event.after_round:
            print(f"resuming run {event.run_id} after round {event.after_round} of {event.rounds}", flush=True)
        if not args.quiet:
            from tqdm import tqdm

            bars.append(tqdm(total=event.rounds, initial=event.after_round, desc=config.run.algorithm, unit="round"))

    def on_event(event: Any) -> None:
        if isinstance(event, RunStarted):
            on_start(event)
        for observe in observers:
            observe(event)

    def on_round(record: dict[str, Any]) -> None:
        traffic[0] += record["bytes_up"] + record["bytes_down"]
        if bars:
            acc = (record["personalized_accuracy"] or {}).get("mean")
            spent = (record.get("privacy") or {}).get("epsilon")  # under --dp: the epsilon spent so far
            bars[0].set_postfix(round=record["round"], acc="-" if acc is None else f"{acc:.3f}",
                                MB=f"{traffic[0] / 1e6:.1f}", **({} if spent is None else {"eps": f"{spent:.2f}"}))
            bars[0].update(1)

    try:
        with observing(config) as observation:
            observers.append(observation.on_event)
            report = run_simulation(config, local=local, on_round=on_round, on_event=on_event)
        if bars:  # the bar's last MB: the run's total, release and final evaluation included
            bars[0].set_postfix(MB=f"{cumulative_megabytes(report)[-1]:.1f}")
    except (RegistrationTimeout, WorkersFailed) as exc:
        raise CommandFailed(str(exc)) from None
    finally:
        for bar in bars:
            bar.close()
    print(summary(report, config.run.out))
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    from edge_sdk.config import ConfigError

    from .hosting.device_ranges import parse_devices

    config = _run_config(args)  # refused before the heavy imports below
    indices = parse_devices(args.devices, config.run.clients, "--devices")
    if not args.start_timeout > 0:
        raise ConfigError(f"--start-timeout must be positive, got {args.start_timeout}")
    from .hosting.worker_watch import WorkersFailed
    from .hosting.workers import DevicesFailed, RunNotAnnounced, host_devices

    try:
        footprint = host_devices(config, indices, start_timeout=args.start_timeout,
                                 on_joined=lambda joined: print(joined.describe(), flush=True))
    except (RunNotAnnounced, DevicesFailed, WorkersFailed) as exc:
        raise CommandFailed(str(exc)) from None
    print(f"run finished; {footprint.devices} devices hosted here")
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    config = _run_config(args)  # refused before the heavy imports below
    from edge_sdk.settings import DEFAULT_BROKER

    from .memory import return_freed_buffers
    from .observe.session import observing
    from .server import Coordinator, RegistrationTimeout

    _check_sharding(config)  # before connecting
    return_freed_buffers()
    transport = config.coordinator_transport(config.broker.broker or DEFAULT_BROKER)
    transport.connect()
    try:
        channel = config.coordinator_channel(transport)
        coordinator = Coordinator(config, channel, partition=_given_partition(args, config))
        with observing(config) as observation:
            coordinator.subscribe(observation.on_event)
            report = coordinator.run()
    except RegistrationTimeout as exc:
        raise CommandFailed(str(exc)) from None
    finally:
        transport.close()
    print(summary(report, config.run.out))
    return 0


def _given_partition(args: argparse.Namespace, config) -> str | None:
    """The run's partition if the user stated it (`--partition`, or `partition` in `--config`):
    devices that hold their own data follow none, so the coordinator assumes none."""
    from edge_sdk.config import load_toml

    document = load_toml(args.config) if args.config else {}
    stated = args.partition is not None or "partition" in document or "partition" in document.get("run", {})
    return config.run.partition if stated else None


def cmd_client(args: argparse.Namespace) -> int:
    from edge_sdk.settings import BrokerSettings

    from .config.sections import SimulationSettings

    simulation = section_from(SimulationSettings, args)
    broker = section_from(BrokerSettings, args)
    mqtt = broker.mqtt_settings(args.client_id)
    data = _device_data(args)
    from edge_sdk.client import EdgeClient  # torch: once the flags, credentials and data are checked
    from edge_sdk.lifecycle import run_until_done

    upload = {"chunk_size": args.chunk_size} if args.chunk_size else {}
    client = EdgeClient(args.client_id, data, broker=mqtt, federation=broker.federation, amp=simulation.amp,
                        device=simulation.device, share_label_counts=not args.no_label_counts, **upload,
                        state_dir=args.state_dir or f"edgepfl-state/{args.client_id}", secagg_keys=_secagg_keys(args))
    run_until_done(client, say_waiting=True)
    return 0


def _add_secagg_key_flags(parser: argparse.ArgumentParser) -> None:
    """--secagg-identity and --secagg-roster: a device's keys for runs under secure aggregation."""
    parser.add_argument("--secagg-identity", metavar="FILE",
                        help="this device's secure-aggregation identity key (`edgepfl secagg-keys`; runs with "
                             "--secure-aggregation need it; default: none)")
    parser.add_argument("--secagg-roster", metavar="FILE",
                        help="every device's public identity key (roster.json of `edgepfl secagg-keys`; default: "
                             "none)")


def _secagg_keys(args: argparse.Namespace):
    """The device's secure-aggregation keys from --secagg-identity and --secagg-roster (both or neither)."""
    if (args.secagg_identity is None) != (args.secagg_roster is None):
        raise CommandFailed("give both --secagg-identity and --secagg-roster (as `edgepfl secagg-keys` wrote them), "
                            "or neither")
    if args.secagg_identity is None:
        return None
    from edge_sdk.secagg.device import SecAggKeys
    from edge_sdk.secagg.errors import SecAggError

    try:
        return SecAggKeys.load(args.secagg_identity, args.secagg_roster)
    except (OSError, SecAggError) as exc:
        raise CommandFailed(f"secure-aggregation keys: {exc}") from None


def cmd_secagg_keys(args: argparse.Namespace) -> int:
    from pathlib import Path

    from edge_sdk.secagg.enroll import enroll

    out = Path(args.out)
    devices = [device.strip() for device in args.devices.split(",") if device.strip()]
    if not devices:
        raise CommandFailed("--devices: give at least one device id")
    if (out / "roster.json").exists() and not args.force:
        raise CommandFailed(f"{out / 'roster.json'} exists: --force replaces every key (each device then needs its "
                            "new identity file and the new roster)")
    enroll(devices, lambda device: out / f"{device}.key", out / "roster.json")
    sys.stdout.write(f"{len(devices)} identity keys and the roster in {out}: give each device its <id>.key "
                     "(--secagg-identity) and every device roster.json (--secagg-roster)\n")
    return 0


def cmd_aggregator(args: argparse.Namespace) -> int:
    from edge_sdk.lifecycle import run_until_done
    from edge_sdk.protocol import aggregator_id
    from edge_sdk.settings import BrokerSettings

    from .shards.aggregator import parse_shard

    shard, shards = parse_shard(args.shard)
    broker = section_from(BrokerSettings, args)
    mqtt = broker.mqtt_settings(aggregator_id(shard))
    verifier = _upload_verifier(broker.credentials, aggregator_id(shard))
    from .shards.aggregator import ShardAggregator  # torch: once the flags and credentials are checked

    aggregator = ShardAggregator(shard, shards, broker=mqtt, federation=broker.federation, verifier=verifier)
    run_until_done(aggregator)
    print(f"aggregator {shard}/{shards}: run {aggregator.run_id} finished, {aggregator.partials_sent} partials sent")
    return 0


def _upload_verifier(credentials: str | None, account: str):
    """The devices' signing keys for an aggregator whose `--credentials` is the fleet's
    credentials.json; None (uploads unchecked, said once) for a file with its own entry only."""
    from edge_sdk.config import ConfigError
    from edge_sdk.signing import SigningKeyError, fleet_verifier

    if not credentials:
        return None
    try:
        verifier = fleet_verifier(credentials)
    except SigningKeyError as exc:
        raise ConfigError(str(exc)) from None
    if verifier is None or not verifier.devices - {account}:
        log.warning("%s enrolls no device keys besides %s's: device uploads are not checked for signatures (give "
                    "the aggregator the fleet's credentials.json to check them)", credentials, account)
        return None
    return verifier


def _device_data(args: argparse.Namespace):
    """A device's own data (--data) or its partition of a built-in dataset (--index)."""
    from edge_sdk.settings import TrainSettings

    from .config.sections import RunSettings
    from .extras import missing_for_data

    if (args.index is None) == (args.data is None):
        raise SystemExit(f"edgepfl {args.command}: give either --index (a partition of --dataset) or --data "
                         "(your own data)")
    run = section_from(RunSettings, args)
    try:
        return run.client_data(args.index, section_from(TrainSettings, args).seed)
    except ModuleNotFoundError as exc:  # what the built-in dataset (or the --data format) needs
        missing = missing_for_data(exc, args.command, run.dataset if args.data is None else None)
        if missing is None:
            raise
        raise missing from exc


def cmd_lite_client(args: argparse.Namespace) -> int:
    from edge_sdk.settings import BrokerSettings

    from .config.sections import SimulationSettings

    head = section_from(SimulationSettings, args).head
    broker = section_from(BrokerSettings, args)
    mqtt = broker.mqtt_settings(args.client_id)
    data = _device_data(args)
    from edge_sdk.lifecycle import run_until_done
    from edge_sdk.lite import LiteClient
    from edge_sdk.lite.client import show_releases

    providers = args.providers if args.providers == "auto" else args.providers.split(",")
    client = LiteClient(args.client_id, data, head=head, providers=providers,
                        share_prototypes=not args.no_prototypes, broker=mqtt, secagg_keys=_secagg_keys(args),
                        federation=broker.federation, state_dir=args.state_dir or f"edgepfl-state/{args.client_id}")
    show_releases()
    run_until_done(client, say_waiting=True)
    if client.missing_model is not None:
        print(f"edgepfl lite-client: {client.missing_model}", file=sys.stderr)
        return 1
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import json

    from .commands.export import export_run

    summary = export_run(args.run, args.out, part=args.part, quantize=args.quantize, also_fp32=args.also_fp32,
                         fp16=args.fp16, calibration_size=args.calibration_size, data_dir=args.data_dir)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from .observe.settings import ObserveSettings, http_address
    from .observe.view import serve_folder

    ObserveSettings(http=args.http, http_token=args.http_token)  # the token rule of --http
    host, port = http_address(args.http)
    serve_folder(args.run_dir, host, port, token=args.http_token,
                 on_start=lambda url: print(f"live view of {args.run_dir} at {url} (Ctrl-C to stop)", flush=True))
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from .brokers.embedded import _serve

    print(f"amqtt broker on mqtt://{args.host}:{args.port} (Ctrl-C to stop)")
    _serve(args.host, args.port)
    return 0


def cmd_broker_config(args: argparse.Namespace) -> int:
    from .brokers.mosquitto import BrokerConfigError, describe, generate

    if args.broker_kind == "nats":
        from .brokers.nats import describe_nats, generate_nats

        if args.tls or args.san or args.user:
            raise BrokerConfigError("--tls, --san and --user are written for Mosquitto only (--broker-kind mosquitto)")
        nodes = args.nodes.split(",") if args.nodes else [args.host]
        cluster = generate_nats(args.out, args.federation, args.devices, args.port or 1883, nodes=nodes,
                                force=args.force, shards=args.shards)
        print(describe_nats(cluster))
        return 0
    if args.nodes:
        raise BrokerConfigError("--nodes is for a NATS cluster (--broker-kind nats)")
    port = args.port if args.port is not None else (8883 if args.tls else 1883)
    setup = generate(args.out, args.federation, args.devices, port, host=args.host, tls=args.tls, sans=args.san,
                     user=args.user, force=args.force, shards=args.shards)
    print(describe(setup))
    return 0


def _add_device_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """What every device command takes: who it is, where its data is, how it reaches the broker."""
    parser.add_argument("--client-id", required=True, help="this device's id (its MQTT client id and username)")
    parser.add_argument("--index", type=int,
                        help="which partition of --dataset is this device's (simulations; default: none, give --data)")
    parser.add_argument("--state-dir", help="where personal state is kept (default: edgepfl-state/<client-id>)")
    add_setting_flags(parser, command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgepfl", description="Personalized federated learning over MQTT")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    simulate = sub.add_parser("simulate", help="a whole federation on this machine over MQTT")
    _add_run_flags(simulate, "simulate")
    simulate.add_argument("--quiet", action="store_true", help="no progress bar")
    simulate.add_argument("--local-devices", metavar="RANGE",
                          help="the devices this host runs, e.g. 0-99 (none: no device here); `edgepfl workers` "
                               "on other hosts runs the rest, over --broker under --federation (default: all)")
    simulate.set_defaults(handler=cmd_simulate)

    workers = sub.add_parser("workers", help="host a share of a simulation's devices on this host")
    _add_run_flags(workers, "simulate", leave_out=("local_aggregators",))  # its aggregators: `edgepfl aggregator`
    workers.add_argument("--devices", required=True, metavar="RANGE",
                         help="the devices this host runs, e.g. 100-199 or 100-149,300 (indices below --clients)")
    workers.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS",
                         help="how long to wait for the coordinator to register devices, and then for these "
                              "devices to join (default: 300)")
    workers.set_defaults(handler=cmd_workers)

    coordinator = sub.add_parser("coordinator", help="run the coordinator against a broker")
    _add_run_flags(coordinator, "coordinator")
    coordinator.set_defaults(handler=cmd_coordinator)

    client = sub.add_parser("client", help="run one trainer device")
    _add_device_flags(client, "client")
    client.add_argument("--chunk-size", type=int,
                        help="largest upload published as one message, in bytes (lower it for a broker whose packet "
                             "limit is smaller and that does not announce it over MQTT 5; default: 64 MiB)")
    client.add_argument("--no-label-counts", action="store_true",
                        help="do not report the training split's count per class when registering")
    _add_secagg_key_flags(client)
    client.set_defaults(handler=cmd_client)

    secagg_keys = sub.add_parser("secagg-keys", help="enroll devices for secure aggregation: an identity key each "
                                                     "and the roster of their public keys")
    secagg_keys.add_argument("--devices", required=True, help="comma-separated device ids")
    secagg_keys.add_argument("--out", required=True, help="folder for <id>.key (one per device) and roster.json")
    secagg_keys.add_argument("--force", action="store_true", help="replace an existing enrollment (new keys)")
    secagg_keys.set_defaults(handler=cmd_secagg_keys)

    aggregator = sub.add_parser("aggregator", help="run one shard aggregator of a run with --shards K")
    aggregator.add_argument("--shard", required=True, metavar="k/K",
                            help="which shard this process sums (0 <= k < K) of the run's K shards")
    add_setting_flags(aggregator, "client", sections=("broker",))
    aggregator.set_defaults(handler=cmd_aggregator)

    lite = sub.add_parser("lite-client", help="run one weak device (ONNX Runtime + a numpy head, no torch)")
    _add_device_flags(lite, "lite-client")
    lite.add_argument("--providers", default="auto",
                      help="ONNX Runtime providers, comma-separated, or auto (default: auto)")
    lite.add_argument("--no-prototypes", action="store_true", help="do not report class counts and means")
    _add_secagg_key_flags(lite)
    lite.set_defaults(handler=cmd_lite_client)

    add_conformance_parser(sub)
    add_audit_parser(sub)
    add_release_parser(sub)

    export = sub.add_parser("export", help="export a run's frozen representation to ONNX (checked against PyTorch)")
    export.add_argument("--run", required=True, help="the run's --out folder (its checkpoint is exported)")
    export.add_argument("--out", required=True, help="the ONNX file to write, in the precision asked for (fp32, "
                                                     "--fp16, or --quantize int8)")
    export.add_argument("--part", default="body", help="which part to export (default: body)")
    export.add_argument("--quantize", choices=["int8"],
                        help="write a static int8 QDQ model (per channel) at --out (default: none, fp32)")
    export.add_argument("--also-fp32", action="store_true",
                        help="with --quantize int8: keep the fp32 model too, as <stem>.fp32.onnx beside --out")
    export.add_argument("--fp16", action="store_true", help="store the weights in float16")
    export.add_argument("--calibration-size", type=int, default=256,
                        help="real images for calibration and checks (default: 256)")
    export.add_argument("--data-dir", help="where the run's dataset is (default: as the run had it)")
    export.set_defaults(handler=cmd_export)

    view = sub.add_parser("view", help="serve the live view's page over a run folder (a finished run, or one "
                                       "going on elsewhere)")
    view.add_argument("run_dir", metavar="RUN_DIR", help="the run's --out folder")
    view.add_argument("--http", default="127.0.0.1:8787", metavar="HOST:PORT",
                      help="where to serve the page (a port alone: on 127.0.0.1; default: 127.0.0.1:8787)")
    view.add_argument("--http-token", metavar="TOKEN",
                      help="require it on every request (open the page with ?token=TOKEN); needed off loopback "
                           "(default: none)")
    view.set_defaults(handler=cmd_view)

    broker = sub.add_parser("broker", help="run the embedded amqtt broker in the foreground")
    broker.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    broker.add_argument("--port", type=int, default=1883, help="port to listen on (default: 1883)")
    broker.set_defaults(handler=cmd_broker)

    broker_config = sub.add_parser("broker-config", help="write a Mosquitto setup (accounts, ACLs, mutual TLS) or a "
                                                         "NATS cluster's (accounts, permissions, nodes)")
    broker_config.add_argument("--broker-kind", choices=["mosquitto", "nats"], default="mosquitto",
                               help="which broker to configure (default: mosquitto)")
    broker_config.add_argument("--nodes", metavar="ADDR,ADDR,...",
                               help="nats: the cluster nodes' addresses, one nats-server configuration each "
                                    "(default: --host alone)")
    broker_config.add_argument("--out", required=True, help="folder for mosquitto.conf, passwords, acl, credentials")
    broker_config.add_argument("--federation", required=True, help="federation name (topic namespace)")
    broker_config.add_argument("--devices", required=True, help="comma-separated device ids (their MQTT usernames)")
    broker_config.add_argument("--port", type=int, help="listener port (default 1883, 8883 with --tls)")
    broker_config.add_argument("--host", default="127.0.0.1",
                               help="address the listener binds (0.0.0.0: all; default: 127.0.0.1)")
    broker_config.add_argument("--tls", action="store_true", help="mutual TLS: a CA, server and client certificates")
    broker_config.add_argument("--san", action="append", default=[], metavar="NAME",
                               help="extra DNS name or IP for the server certificate (repeatable; default: none)")
    broker_config.add_argument("--user", help="account mosquitto runs as when started as root (default: you)")
    broker_config.add_argument("--force", action="store_true", help="replace an existing setup (new passwords)")
    broker_config.add_argument("--shards", type=int, default=0,
                               help="the runs' --shards K: accounts aggregator-0..K-1 and the shard topics in the "
                                    "ACL (default: 0, no sharded aggregation)")
    broker_config.set_defaults(handler=cmd_broker_config)
    _verbosity_after_commands(parser)
    return parser


def _verbosity_after_commands(parser: argparse.ArgumentParser) -> None:
    """Accept -v after a command's name too (`edgepfl simulate ... -v`), as users type it: every
    command parser, nested ones included, takes it; absent there, the value before the name stands."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for command in action.choices.values():
            command.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                                 help="more logging (-v info, -vv debug)")
            _verbosity_after_commands(command)


def main(argv: list[str] | None = None) -> int:
    command = None  # SIGTERM unwinds from here on: also while the command starts up (imports, checks)
    _unwind_on_sigterm()
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        return _run(args)
    except (KeyboardInterrupt, Terminated) as stop:
        how, code = ("interrupted", INTERRUPTED) if isinstance(stop, KeyboardInterrupt) else ("terminated", TERMINATED)
        resume = " (rerun the same command to resume)" if command in ("simulate", "coordinator") else ""
        print(f"edgepfl{f' {command}' if command else ''}: {how}{resume}", file=sys.stderr)
        return code


def _run(args: argparse.Namespace) -> int:
    """The command's handler, its failures turned into one line and an exit code."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from edge_sdk.config import ConfigError
    from edge_sdk.transport import TransportError

    from .extras import MissingExtra, missing_extra
    from .run.checkpoint import CheckpointError

    try:
        return args.handler(args)
    except (MissingExtra, ModuleNotFoundError) as exc:
        missing = exc if isinstance(exc, MissingExtra) else missing_extra(exc, args.command)
        if missing is None:  # not an optional module that is absent: a bug or a broken install
            raise
        log.debug("the failure's traceback", exc_info=exc)
        print(missing, file=sys.stderr)
        return USAGE_ERROR
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as exc:
        return _fail(args.command, exc, USAGE_ERROR)
    except (TransportError, CommandFailed) as exc:
        return _fail(args.command, exc, RUNTIME_FAILURE)


def _fail(command: str, exc: BaseException, code: int) -> int:
    """Print `exc` as one line (its traceback only at -vv) and return the exit code `code`."""
    log.debug("the failure's traceback", exc_info=exc)
    print(f"edgepfl {command}: {exc}", file=sys.stderr)
    return code


if __name__ == "__main__":
    status = main()
    gc.freeze()  # the command is done: exit without collecting its heap of torch objects (seconds after a run)
    sys.exit(status)

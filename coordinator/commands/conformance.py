"""The `edgepfl conformance` subcommand: its flags, what it runs and what it prints (the kit,
`coordinator.conformance`, only returns its report).

Only light modules are imported here; the kit (and torch, for the run's model) once the flags
and the signing key are checked. The exit code is 0 when every section passed or did not apply,
1 when one failed.
"""

from __future__ import annotations

import argparse
import sys

from ..config.flags import add_setting_flags, section_from


def add_conformance_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("conformance", help="check a device against the protocol: play the coordinator's side "
                                                "and print PASS, FAIL or SKIP per section of docs/PROTOCOL.md")
    parser.add_argument("--device-id", required=True, help="the client id of the device under test")
    parser.add_argument("--dataset", help="the built-in task to play (default: the task the device's HELLO names)")
    parser.add_argument("--model", default="auto", help="the run's model (default: auto, the task's default model)")
    parser.add_argument("--signing-key", metavar="HEX",
                        help="the device's signing key, 64 hex digits: its seals are checked (default: the device's "
                             "signing_key in --credentials, if any; none: seals are not checked)")
    parser.add_argument("--hello-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long to wait for the device's HELLO (default: 60)")
    parser.add_argument("--reply-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="how long to wait for each reply (default: 120)")
    parser.add_argument("--quiet-seconds", type=float, default=1.0, metavar="SECONDS",
                        help="how long to listen for late replies to the bad requests (default: 1)")
    add_setting_flags(parser, "client", sections=("broker",))
    parser.set_defaults(handler=cmd_conformance)


def cmd_conformance(args: argparse.Namespace) -> int:
    from edge_sdk.config import ConfigError
    from edge_sdk.protocol import COORDINATOR, check_client_id
    from edge_sdk.settings import BrokerSettings
    from edge_sdk.signing import device_key, parse_key

    check_client_id(args.device_id)
    for name in ("hello_timeout", "reply_timeout", "quiet_seconds"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    broker = section_from(BrokerSettings, args)
    mqtt = broker.mqtt_settings(COORDINATOR)
    key = (parse_key(args.signing_key, args.device_id) if args.signing_key is not None
           else device_key(broker.credentials, args.device_id) if broker.credentials else None)
    from ..conformance.kit import run_kit  # torch: once the flags are checked
    from ..conformance.sections import KitSettings

    settings = KitSettings(args.device_id, dataset=args.dataset, model=args.model, signing_key=key,
                           hello_timeout=args.hello_timeout, reply_timeout=args.reply_timeout,
                           quiet_seconds=args.quiet_seconds)
    report = run_kit(mqtt, broker.federation, settings)
    verdict = f"conformance of {args.device_id}: {'passed' if report.passed else 'FAILED'}"
    sys.stdout.write("\n".join([*report.lines(), verdict]) + "\n")  # the command's output, not a log line
    return 0 if report.passed else 1

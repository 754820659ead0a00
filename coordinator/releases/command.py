"""`edgepfl release serve | list | publish | promote | rollback`: a run's releases after training.

`serve` keeps answering weak devices over the broker (`service.ReleaseService`); the others read
or change `<run>/releases/` (`store.ReleaseStore`) and return at once: a running service picks
their change up within a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..config.flags import add_setting_flags, section_from
from .store import ReleaseError, ReleaseStore

DEFAULT_FRACTION = 0.2
DEFAULT_TOLERANCE = 0.01


def add_release_parser(sub: argparse._SubParsersAction) -> None:
    release = sub.add_parser("release", help="a run's numbered releases after training: serve them to weak devices, "
                                             "list, publish, promote (staged) and roll back")
    commands = release.add_subparsers(dest="release_command", required=True)

    def command(name: str, handler: Any, help: str, run: str = "the run's --out folder") -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help)
        parser.add_argument("--run", required=True, help=run)
        parser.set_defaults(handler=handler)
        return parser

    serve = command("serve", cmd_serve, "answer weak devices on the current release after training ended (Ctrl-C "
                    "to stop; restart it any time)", run="the training run's --out folder")
    serve.add_argument("--canary-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="how long a staged rollout waits for its canaries before it decides on those that "
                            "answered (default: 600)")
    add_setting_flags(serve, "coordinator", sections=("broker",))

    listing = command("list", cmd_list, "the releases, the one current, the rollout and the inventory")
    listing.add_argument("--json", action="store_true", help="print JSON instead of text")

    publish = command("publish", cmd_publish, "add a release: another run's current release, or an ONNX "
                      "representation (it is staged with `promote`)", run="the run whose releases it joins")
    publish.add_argument("source", metavar="SOURCE", help="a run folder (its current release) or an .onnx file")

    promote = command("promote", cmd_promote, "roll release N out: to --fraction of the weak devices first, to all "
                      "when their accuracy holds")
    promote.add_argument("version", type=int, metavar="N", help="the release to roll out")
    promote.add_argument("--fraction", type=float, default=DEFAULT_FRACTION,
                         help=f"share of the online weak devices that get it first (default: {DEFAULT_FRACTION})")
    promote.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                         help="the largest drop of the canaries' mean accuracy that still promotes it "
                              f"(default: {DEFAULT_TOLERANCE})")

    rollback = command("rollback", cmd_rollback, "go back to the release current before this one (or stop the "
                       "rollout under way)")
    rollback.add_argument("--reason", default="by the operator", help="recorded with it (default: by the operator)")


def _say(*lines: str) -> None:
    """The command's output on stdout (not a log line: it is what the user asked for)."""
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()


def cmd_serve(args: argparse.Namespace) -> int:
    from edge_sdk.settings import DEFAULT_BROKER, BrokerSettings
    from edge_sdk.transport import MqttTransport

    from .service import ReleaseService

    run = finished_run(args.run)
    broker = section_from(BrokerSettings, args)
    transport = MqttTransport(f"{broker.federation}.releases", broker.mqtt_settings("coordinator",
                                                                                     broker.broker or DEFAULT_BROKER))
    transport.connect()
    try:
        service = ReleaseService(args.run, _channel(broker, transport), canary_timeout=args.canary_timeout, **run)
        _say(f"serving release {service.state.current} of run {run['run_id']} to weak devices of federation "
             f"{broker.federation} (Ctrl-C to stop)")
        service.run(transport.failed)
    finally:
        transport.close()
    if transport.failure is not None:
        raise transport.failure
    return 0


def _channel(broker: Any, transport: Any) -> Any:
    """The service's channel: checks the devices' signatures when `credentials` enrolls their keys."""
    from edge_sdk.channel import Channel
    from edge_sdk.protocol import Topics
    from edge_sdk.signing import fleet_verifier

    verifier = fleet_verifier(broker.credentials) if broker.credentials else None
    return Channel(transport, Topics(broker.federation), chunk_size=broker.chunk_size, max_pending_blobs=256,
                   verifier=verifier)


def finished_run(run_dir: str) -> dict[str, Any]:
    """What the release service needs of a run from its checkpoint: its id, rounds, algorithm,
    the training settings devices receive in WELCOME and the number of classes."""
    from ..config.run_config import RunConfig
    from ..run.checkpoint import load
    from ..run.folder import RunFolder

    saved = load(RunFolder(run_dir).checkpoint)
    if saved is None:
        raise FileNotFoundError(f"{run_dir}: no run here (no checkpoint); give a training run's --out folder")
    record = dict(saved.history["config"])
    task = record.pop("task")
    config = RunConfig.of(**record)
    if config.privacy.dp != "off":
        raise ReleaseError(f"run {saved.run_id} trained under differential privacy: its weak devices' evaluations and "
                           "prototypes are covered by no mechanism after training, so `release serve` refuses it")
    return {"run_id": saved.run_id, "rounds": saved.round, "algorithm": config.run.algorithm,
            "settings": config.welcome_settings(), "num_classes": int(task["num_classes"])}


def cmd_list(args: argparse.Namespace) -> int:
    from .inventory import Inventory

    store = ReleaseStore(args.run)
    versions, state, inventory = store.versions(), store.read_state(), Inventory(args.run).devices
    if args.json:
        _say(json.dumps({"current": state.current, "versions": [vars(v) for v in versions],
                         "rollout": state.to_json()["rollout"], "history": state.history, "inventory": inventory},
                        indent=2))
        return 0
    if not versions:
        _say(f"{args.run}: no release yet")
        return 0
    lines = ["release  sha256        accuracy  source                     created"]
    for v in versions:
        mark = "*" if v.version == state.current else " "
        accuracy = "-" if v.accuracy is None else f"{v.accuracy:.4f}"
        source = v.source.get("run_id") or v.source.get("file", "")
        lines.append(f"{mark}{v.version:<7} {v.sha256[:12]}  {accuracy:<8}  {str(source)[:26]:<26} {_when(v.created)}")
    if state.rollout is not None:
        rollout = state.rollout
        canaries = ", ".join(rollout.canaries) or "(being chosen)"
        lines.append(f"rollout of release {rollout.candidate}: canaries {canaries}; {len(rollout.results)} reported")
    lines += [f"  {_when(entry['time'])} {entry['action']} {entry['version']}: {entry['reason']}"
              for entry in state.history[-5:]]
    if inventory:
        lines.append("device       runs  accuracy  evaluated  kept                       reported")
        for device, entry in sorted(inventory.items()):
            accuracy = "-" if entry.get("accuracy") is None else f"{entry['accuracy']:.4f}"
            lines.append(f"{device:<12} {entry.get('runs')!s:<5} {accuracy:<9} {entry.get('evaluated')!s:<10} "
                         f"{(entry.get('kept') or '-')[:26]:<26} {_when(entry['reported'])}")
    _say(*lines)
    return 0


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def cmd_publish(args: argparse.Namespace) -> int:
    data, metadata, source = _release_source(Path(args.source))
    entry = ReleaseStore(args.run).add(data, metadata, source, None, f"published from {args.source}")
    _say(f"release {entry.version} ({entry.sha256[:12]}, {entry.size} bytes) added to {args.run}; roll it out with "
         f"`edgepfl release promote {entry.version} --run {args.run}`")
    return 0


def _release_source(source: Path) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """The bytes, metadata and source record of a run folder's current release or of an ONNX file
    (loaded by ONNX Runtime first: a file it cannot load is refused here, not on the devices)."""
    from edge_sdk.lite.features import FeatureExtractor, RepresentationError

    if source.is_dir():
        current = ReleaseStore(source).current()
        if current is None:
            raise ReleaseError(f"{source} holds no release")
        origin = {"run_id": current.source.get("run_id"), "round": current.source.get("round"),
                  "folder": str(source), "version": current.version}
        return ReleaseStore(source).data(current.version), current.metadata, origin
    if not source.is_file():
        raise ReleaseError(f"{source}: neither a run folder nor an .onnx file")
    data = source.read_bytes()
    try:
        metadata = FeatureExtractor(data, "CPUExecutionProvider").metadata
    except RepresentationError as exc:
        raise ReleaseError(f"{source}: {exc}") from None
    if "feature_dim" not in metadata:
        raise ReleaseError(f"{source}: its metadata names no feature_dim; export representations with `edgepfl export`")
    return data, metadata, {"file": str(source)}


def cmd_promote(args: argparse.Namespace) -> int:
    ReleaseStore(args.run).request_rollout(args.version, args.fraction, args.tolerance)
    _say(f"release {args.version} staged: `edgepfl release serve --run {args.run}` sends it to {args.fraction:.0%} "
         "of the online weak devices first; `edgepfl release list` shows the outcome")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    version = ReleaseStore(args.run).roll_back(args.reason)
    _say(f"release {version} is current in {args.run}")
    return 0

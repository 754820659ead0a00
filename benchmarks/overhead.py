"""MQTT overhead: the same federated training over MQTT and in-process, wall time per round.

Full run (about 8 minutes on 2 cores; Mosquitto installed, and Fashion-MNIST in
/usr/share/datasets/fashion-mnist or --data-dir):

    python -m benchmarks.overhead --out benchmarks/results

Quick (a smoke test, well under a minute): `python -m benchmarks.overhead --quick --out DIR`
(digits, 3 devices, 2 rounds). `--broker mqtt://host:port` replaces the two broker variants by
that broker.

The run: fedavg, the default CNN for the dataset (cnn28 on Fashion-MNIST), 10 devices, iid,
5 rounds of 2 local epochs, evaluation every round, seed 0, on the CPU (`--device`), devices in
`--workers` processes (default: one per core), one torch thread each. Variants:

- `amqtt`, `mosquitto`: `coordinator.hosting.simulate.run_simulation(RunConfig(...))`, the product path:
  the coordinator in this process, the devices (`EdgeClient`) in worker processes, each with its
  own MQTT connection, through the embedded amqtt broker or a Mosquitto started here.
- `inprocess`: the baseline, a plain loop with the same computation and the same process layout:
  the same worker processes host the same devices (`EdgeClient`s, built from the WELCOME the real
  `Coordinator` writes, handed each envelope through `DeviceSession.handle`, the public entry
  `run` uses on receipt, so they train and evaluate through their own handlers; only `send`, the
  one way out of a device, is overridden, so their replies come back as Python objects instead of
  being published); this
  process runs the same server algorithm object (selection, `check_update`, `accumulate`,
  `end_round`, the checkpoint every round) and hands tasks and replies to the workers over
  multiprocessing pipes. No encoding, chunking, broker or MQTT client anywhere. Why this and not
  the LoopbackBroker: the loopback broker is in-memory, so every device would have to live in this
  one process, and the devices' Python work would then share one GIL instead of spreading over
  the worker processes the MQTT runs use: the baseline would be slower than the real layout and
  flatter the ratio. The round's coordinator side is `coordinator.rounds.inprocess.InProcessRound`
  (`begin_round`, the task, the coordinator's own update checks, `accumulate`, `end_round`),
  the WELCOMEs are the real `Coordinator.welcome`.
- `loopback` (optional, `--variants`): the same `Coordinator` and `EdgeClient`s over
  `edge_sdk.loopback.LoopbackBroker`, all in this process, devices as threads with one compute
  lock per would-be worker: the protocol without the network, under one GIL.

Round time is the coordinator's own per-round `seconds` (selection to the end of that round's
evaluation) and, in the loop, the same span. The ratio is MQTT / in-process per round; the
headline is the ratio of the summed round times. Identical computation is checked by the final
personalized accuracy, which should agree across variants. Time the coordinator's channel spends
sending and accepting messages is read per round from the coordinator's `RoundEnded` event (its
channel's counters) to show where a gap comes from.

Writes overhead.json, overhead.md and overhead.png to --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import cast

from coordinator.config.run_config import RunConfig
from coordinator.run.folder import RunFolder
from edge_sdk.channel import Channel

from ._brokers import broker, machine_info
from .flags import add_output_flags, add_run_flags

MB = 1_000_000


# -- the coordinator's rounds, as its events report them ------------------------------------
def _round_entry(event) -> dict:
    """One round's line from the coordinator's `RoundEnded` event."""
    entry = event.record
    return {"round": entry["round"], "seconds": entry["seconds"], "participants": entry["participants"],
            "accuracy": (entry.get("personalized_accuracy") or {}).get("mean"), "bytes_up": entry["bytes_up"],
            "bytes_down": entry["bytes_down"], "coordinator_send_seconds": event.channel.send_seconds,
            "coordinator_accept_seconds": event.channel.accept_seconds}


# -- the MQTT variants -----------------------------------------------------------------------
def run_mqtt(config: RunConfig) -> dict:
    from coordinator.hosting.simulate import run_simulation

    from coordinator.events import RoundEnded

    rounds: list[dict] = []

    def on_event(event) -> None:
        if isinstance(event, RoundEnded):
            rounds.append(_round_entry(event))

    started = time.monotonic()
    report = run_simulation(config, on_event=on_event)
    wall = time.monotonic() - started
    return {"rounds": rounds, "wall_seconds": wall,
            "final_accuracy": report["final"]["personalized_accuracy"]["mean"],
            "bytes_up": report["communication"]["bytes_up"], "bytes_down": report["communication"]["bytes_down"],
            "rejections": report["rejections"]}


# -- the loopback variant --------------------------------------------------------------------
def run_loopback(config: RunConfig) -> dict:
    import torch

    from coordinator.events import RoundEnded
    from coordinator.hosting.simulate import client_id_for, split_among_workers
    from coordinator.server import Coordinator
    from edge_sdk.client import EdgeClient
    from edge_sdk.loopback import LoopbackBroker
    from edge_sdk.protocol import Topics

    torch.set_num_threads(1)
    hub = LoopbackBroker()
    federation = config.broker.federation
    threads = []
    for indices in split_among_workers(range(config.run.clients), config.worker_count):
        lock = threading.Lock()
        for index in indices:
            data = config.run.client_data(index, config.training.seed)
            client_id = client_id_for(index)
            client = EdgeClient(client_id, data, device=config.simulation.device, compute_lock=lock,
                                federation=federation, state_dir=RunFolder(config.run.out).device_state(client_id),
                                chunk_size=config.broker.chunk_size,
                                transport=hub.transport(f"{federation}.{client_id}"))
            threads.append(threading.Thread(target=client.run, name=client_id, daemon=True))
    transport = hub.transport(f"{federation}.coordinator")
    transport.connect()
    rounds: list[dict] = []
    coordinator = Coordinator(config, Channel(transport, Topics(federation), chunk_size=config.broker.chunk_size))
    coordinator.subscribe(lambda event: rounds.append(_round_entry(event)), RoundEnded)
    started = time.monotonic()
    for thread in threads:
        thread.start()
    report = coordinator.run()
    wall = time.monotonic() - started
    for thread in threads:
        thread.join(timeout=30)
    return {"rounds": rounds, "wall_seconds": wall, "final_accuracy": report["final"]["personalized_accuracy"]["mean"],
            "bytes_up": report["communication"]["bytes_up"], "bytes_down": report["communication"]["bytes_down"],
            "rejections": report["rejections"]}


# -- the in-process baseline -----------------------------------------------------------------
def _direct_worker(config: RunConfig, indices: tuple[int, ...], conn) -> None:
    """A worker process of the plain loop: the same devices as simulate's worker, no wire."""
    import torch

    from coordinator.hosting.simulate import client_id_for, skip_final_collection
    from edge_sdk.client import EdgeClient
    from edge_sdk.loopback import LoopbackBroker
    from edge_sdk.protocol import Envelope

    class DirectClient(EdgeClient):
        """An EdgeClient whose replies are kept as Python objects instead of being published: its
        `send` (the one way out of a device) appends to `outbox`; envelopes come in by `handle`."""

        outbox: list

        def send(self, kind, round_=0, *, request=None, **fields) -> None:
            self.outbox.append(Envelope(kind, self.client_id, run_id=self.run_id or "", round=round_, **fields))

    torch.set_num_threads(1)
    unused = LoopbackBroker()
    clients = []
    for index in indices:
        data = config.run.client_data(index, config.training.seed)
        client_id = client_id_for(index)
        client = DirectClient(client_id, data, device=config.simulation.device, federation=config.broker.federation,
                              state_dir=RunFolder(config.run.out).device_state(client_id),
                              transport=unused.transport(client_id))
        client.outbox = []
        clients.append(client)
    conn.send([(c.client_id, *c.hello()) for c in clients])
    while True:
        command, payload = conn.recv()
        if command == "stop":
            skip_final_collection()  # as simulate's workers: the run waits for this process to end
            return
        replies = []
        for client in clients:
            envelope = payload[client.client_id] if command == "welcome" else payload
            client.outbox.clear()
            client.handle(envelope)  # WELCOME, TRAIN or EVALUATE, as `run` would on receiving it
            replies += client.outbox
        conn.send(replies)


def run_inprocess(config: RunConfig) -> dict:
    from coordinator.aggregation.validation import UpdateLimits
    from coordinator.hosting.simulate import split_among_workers
    from coordinator.rounds.collector import select_clients
    from coordinator.rounds.inprocess import InProcessRound
    from coordinator.run import checkpoint
    from coordinator.server import Coordinator
    from edge_sdk.config import to_plain
    from edge_sdk.loopback import LoopbackBroker
    from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics

    started = time.monotonic()
    context = multiprocessing.get_context("spawn")
    workers, conns = [], []
    for indices in split_among_workers(range(config.run.clients), config.worker_count):
        parent, child = context.Pipe()
        process = context.Process(target=_direct_worker, args=(config, indices, child), daemon=True)
        process.start()
        workers.append(process)
        conns.append(parent)
    try:
        # the real Coordinator (on an unused loopback channel) writes the WELCOMEs and holds the server algorithm
        transport = LoopbackBroker().transport(f"{config.broker.federation}.coordinator")
        coordinator = Coordinator(config, Channel(transport, Topics(config.broker.federation)))
        algorithm = coordinator.algorithm
        examples: dict[str, int] = {}
        welcomes: list[dict] = []
        for conn in conns:
            welcome: dict = {}
            for client_id, metrics, _ in conn.recv():
                examples[client_id] = int(metrics["num_examples"])
                welcome[client_id] = coordinator.welcome(client_id)
            welcomes.append(welcome)
        for conn, welcome in zip(conns, welcomes, strict=True):
            conn.send(("welcome", welcome))
        for conn in conns:
            conn.recv()
        limits = UpdateLimits(config.round.max_examples, config.round.max_update_norm)
        folder = RunFolder(config.run.out)

        def broadcast(command: str, envelope: Envelope, on_reply) -> None:
            for conn in conns:
                conn.send((command, envelope))
            pending = list(conns)
            while pending:
                for conn in cast("list[Connection]", wait(pending)):
                    pending.remove(conn)
                    for reply in conn.recv():
                        on_reply(reply)

        rounds: list[dict] = []
        devices = sorted(examples)
        accuracy = None
        for round_ in range(1, config.training.rounds + 1):
            began = time.monotonic()
            selected = select_clients(devices, config.round.fraction, config.training.seed, round_)
            training = InProcessRound(algorithm, round_, selected, run_id=coordinator.run_id,
                                      codec=config.training.upload_codec, limits=limits)
            broadcast("train", training.task,
                      lambda reply, training=training: training.accept(reply, examples[reply.sender]))
            training.finish()
            results: dict[str, float] = {}
            request = Envelope(Kind.EVALUATE, COORDINATOR, run_id=coordinator.run_id, round=round_,
                               groups=algorithm.eval_groups(),
                               config={"selected": devices, "final": round_ >= config.training.rounds,
                                       "phase": "round"})
            broadcast("evaluate", request,
                      lambda reply, results=results: results.__setitem__(reply.sender, reply.metrics["accuracy"]))
            seconds = time.monotonic() - began
            accuracy = statistics.fmean(results.values())
            checkpoint.save(folder.checkpoint, checkpoint.Checkpoint(coordinator.run_id, round_, config.fingerprint(),
                                                                     algorithm.state, {"config": to_plain(config)}))
            rounds.append({"round": round_, "seconds": seconds, "participants": len(training.weights),
                           "accuracy": accuracy})
        wall = time.monotonic() - started
        for conn in conns:
            conn.send(("stop", None))
        return {"rounds": rounds, "wall_seconds": wall, "final_accuracy": accuracy}
    finally:
        for process in workers:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()


# -- the report ------------------------------------------------------------------------------
def compare(results: dict[str, dict], baseline: str) -> dict:
    base = results.get(baseline)
    out = {}
    for name, result in results.items():
        if name == baseline or "rounds" not in result or not base or "rounds" not in base:
            continue
        per_round = [m["seconds"] / b["seconds"] for m, b in zip(result["rounds"], base["rounds"], strict=False)]
        total = sum(r["seconds"] for r in result["rounds"]) / sum(r["seconds"] for r in base["rounds"])
        later = result["rounds"][1:], base["rounds"][1:]
        out[name] = {
            "ratio": total,
            "ratio_per_round": per_round,
            "ratio_after_round_1": (sum(r["seconds"] for r in later[0]) / sum(r["seconds"] for r in later[1])
                                    if later[1] else None),
            "gap_seconds_per_round": [m["seconds"] - b["seconds"]
                                      for m, b in zip(result["rounds"], base["rounds"], strict=False)],
            "coordinator_messaging_seconds_per_round": [r.get("coordinator_send_seconds", 0.0)
                                                        + r.get("coordinator_accept_seconds", 0.0)
                                                        for r in result["rounds"]],
        }
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"fedavg, {s['dataset']}, model {s['model']}, {s['clients']} devices, {s['rounds']} rounds x "
             f"{s['local_epochs']} local epochs, {s['workers']} worker processes, device {s['device']}, "
             f"seed {s['seed']}", "",
             "| variant | round | seconds | ratio to in-process | coordinator send s | coordinator receive s "
             "| MB up | MB down "
             "| accuracy |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in result["variants"].items():
        if "error" in run:
            lines.append(f"| {name} | failed: {run['error']} ||||||||")
            continue
        ratios = result["ratios"].get(name, {}).get("ratio_per_round", [])
        for i, r in enumerate(run["rounds"]):
            ratio = f"{ratios[i]:.3f}" if i < len(ratios) else "1" if name == result["baseline"] else "-"
            lines.append(
                f"| {name} | {r['round']} | {r['seconds']:.2f} | {ratio} | {r.get('coordinator_send_seconds', 0):.3f} "
                f"| {r.get('coordinator_accept_seconds', 0):.3f} | {(r.get('bytes_up') or 0) / MB:.2f} "
                f"| {(r.get('bytes_down') or 0) / MB:.2f} "
                f"| {r['accuracy'] if r['accuracy'] is None else round(r['accuracy'], 4)} |")
    lines += ["", "| variant | sum of round seconds | ratio (sum) | ratio after round 1 | final accuracy "
                  "| whole run s |",
              "|---|---|---|---|---|---|"]
    for name, run in result["variants"].items():
        if "error" in run:
            continue
        ratio = result["ratios"].get(name, {})
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {name} | {sum(r['seconds'] for r in run['rounds']):.2f} "
                     f"| {fmt(ratio.get('ratio', 1.0 if name == result['baseline'] else None))} "
                     f"| {fmt(ratio.get('ratio_after_round_1'))} | {fmt(run['final_accuracy'])} "
                     f"| {run['wall_seconds']:.1f} |")
    t = result["targets"]
    lines += ["", "## Target", "",
              f"- MQTT / in-process wall time per round <= {t['max_ratio']} ({s['dataset']}, {s['clients']} devices): "
              + ", ".join(f"{k} {v:.3f} ({'met' if v <= t['max_ratio'] else 'missed'})"
                          for k, v in t["ratios"].items()),
              "", f"machine: {result['machine']['cpu_model']}, {result['machine']['cores']} cores, "
              "load average at start "
              f"{result['machine']['load_average_at_start']}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [n for n, r in result["variants"].items() if "rounds" in r]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        rounds = result["variants"][name]["rounds"]
        ax.bar([r["round"] + (i - (len(names) - 1) / 2) * width for r in rounds], [r["seconds"] for r in rounds],
               width=width, label=name)
    ax.set(xlabel="round", ylabel="seconds (selection to end of evaluation)", title="Round wall time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits, 3 devices, 2 rounds")
    parser.add_argument("--variants", default="amqtt,mosquitto,inprocess",
                        help="comma-separated: amqtt, mosquitto, inprocess, loopback (a --broker replaces amqtt and "
                             "mosquitto)")
    add_run_flags(parser, ("dataset", "data_dir", "clients", "rounds", "local_epochs", "workers", "device", "seed"),
                  {"dataset": None, "clients": None, "rounds": None, "device": "cpu"})
    parser.epilog = (parser.epilog or "") + (" Without --quick: --dataset fmnist, --clients 10, --rounds 5; with it: "
                                             "digits, 3 and 2.")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(",")
    if args.broker:
        variants = ["external" if v in ("amqtt", "mosquitto") else v for v in variants]
        variants = list(dict.fromkeys(variants))
    workers = args.workers or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="edgepfl-overhead-") as workdir:
        base = RunConfig.of(algorithm="fedavg", dataset=args.dataset or ("digits" if args.quick else "fmnist"),
                            data_dir=args.data_dir, clients=args.clients or (3 if args.quick else 10),
                            rounds=args.rounds or (2 if args.quick else 5), local_epochs=args.local_epochs,
                            seed=args.seed, workers=workers, device=args.device, eval_every=1, round_timeout=600.0,
                            registration_timeout=300.0, quorum_grace=0.0)
        base = base.replace(min_clients=base.run.clients)
        result: dict = {"machine": machine_info(), "baseline": "inprocess",
                        "settings": {"quick": args.quick, "dataset": base.run.dataset, "model": base.model_name,
                                     "clients": base.run.clients, "rounds": base.training.rounds,
                                     "local_epochs": base.training.local_epochs,
                                     "workers": workers, "device": base.simulation.device, "seed": base.training.seed,
                                     "variants": variants, "broker": args.broker},
                        "variants": {}}
        for name in variants:
            config = base.replace(out=str(Path(workdir) / name), federation=f"overhead-{uuid.uuid4().hex[:8]}")
            print(f"{name} ...", flush=True)
            try:
                if name == "inprocess":
                    run = run_inprocess(config)
                elif name == "loopback":
                    run = run_loopback(config)
                elif name == "amqtt":
                    run = run_mqtt(config)  # broker=None: run_simulation starts the embedded amqtt broker
                else:
                    with broker(args.broker or name, Path(workdir) / name) as (url, protocol, _):
                        run = run_mqtt(config.replace(broker=url, mqtt_protocol=protocol))
            except Exception as exc:  # a variant that fails is reported, the others still run
                run = {"error": f"{type(exc).__name__}: {exc}"}
            result["variants"][name] = run
            print(f"{name}: " + (run["error"] if "error" in run else
                  ", ".join(f"{r['seconds']:.2f}" for r in run["rounds"])
                  + f" s per round, accuracy {run['final_accuracy']}"),
                  flush=True)
    result["ratios"] = compare(result["variants"], "inprocess")
    result["targets"] = {"max_ratio": 1.15,
                         "ratios": {name: r["ratio"] for name, r in result["ratios"].items() if name != "loopback"}}
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    (out / "overhead.md").write_text(markdown(result))
    plot(result, out / "overhead.png")
    print(markdown(result))


if __name__ == "__main__":
    main()

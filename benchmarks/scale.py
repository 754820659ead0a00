"""Coordinator scale: 100, 500 and 1,000 devices, each a real MQTT connection, through Mosquitto.

Full run (Mosquitto installed; about 8 GB of free memory; 5 to 20 minutes on 2 cores; a round
that loses an update lasts until --round-timeout, 180 s):

    python -m benchmarks.scale --out benchmarks/results

Quick (a smoke test, well under a minute): `python -m benchmarks.scale --quick --out DIR` (20 and
50 devices, 2 rounds, the 0.15M-parameter cnn8). `--broker mqtt://host:port` uses an existing
broker instead of starting Mosquitto with the config written here.

The coordinator is set up exactly as `edgepfl coordinator` sets it up (`RunConfig`'s
coordinator transport and channel, FedAvg, the library's defaults unless a flag below says
otherwise), alone in its own process so that its memory is its own. The devices are a
lightweight `DeviceSession` subclass defined here (registers with HELLO, answers TRAIN at once
with an update of exactly the broadcast names, shapes and dtypes, and EVALUATE with a fixed
accuracy), hosted as threads in several device processes, one MQTT connection each. Default
model: cnn32 on CIFAR-100's shape (924,804 parameters, 3.7 MB of float32), so every device
uploads a ~1M-parameter update; the coordinator only needs the dataset's shape, never its data.

Per device count it records, from the coordinator's public events (`Coordinator.subscribe`)
and its channel's counters (`Channel.counters`), nothing patched: the time to register all
devices (from starting the device processes, and from their first connection attempt), per round
the latency (the round's start to the end of `end_round`: broadcast, collection, validation and
aggregation), the aggregation time (the algorithm's `accumulate` and `end_round`), the
validation time (decoding the upload codec, `check_update` and the algorithm's own checks), the
coordinator's peak RSS over the whole round (the kernel's high-water mark, VmHWM, reset when the
round starts through /proc/self/clear_refs and read once the round is recorded: broadcast,
collection, aggregation, the last round's evaluation and the checkpoint) and its peak over the
RSS before round 1, as a multiple of the model's size, the backlog of the coordinator's incoming
queue (messages, and bytes held under flow control) and of the reassembly (partly received
chunked messages), the rejections, and whether every update arrived (updates accepted ==
devices; the quorum is set to all devices so a round waits for every update until
`--round-timeout`). Also the broker's RSS and Mosquitto's $SYS count of
dropped messages. Evaluation runs once, after the last round. The simulated devices use an MQTT
keepalive of 300 s (`--device-keepalive`): hundreds of them share a few cores here, and a
device's PINGRESP waits behind the broadcast its process has not read yet.

Configuration flags (the library's defaults unless given): `--chunk-size` (the coordinator's
broadcasts), `--upload-chunk-size` (the devices' uploads), `--flow-control-bytes` (the
coordinator's), `--mosquitto-max-queued` (Mosquitto's per-client queue, as `edgepfl
broker-config` writes it: no limit).

Writes scale.json, scale.md and scale.png (coordinator RSS over time) to --out.

Cluster (`--cluster`, as root; prints why and exits otherwise): per device count a fresh
topology from harness/hosts.py and harness/nats_cluster.py (the cluster tests' own): three hosts
(network namespaces on a bridge), a NATS node on each (JetStream, MQTT 3.1.1), the coordinator
process on host 1 with `--shards K` (`--shards`, default 2), `edgepfl aggregator --shard k/K`
processes on hosts 2 and 3, and device process w on host w % 3 + 1 connected to its own host's
node (each process setns()es into its host's namespace before it connects). Default 500, 2,000,
5,000 and 10,000 devices, 1 round, mlp on digits (26,122 parameters, 104 KB of float32, so
~100 KB updates); quick: 30 devices. Beside the figures above (the updates accepted are then
the round's participants, all folded by the aggregators), the aggregators' and NATS nodes' peak
RSS (VmHWM) and RSS once every device registered. `--nats-consumer-replicas` and
`--nats-consumer-memory` set how NATS keeps the JetStream consumer it makes for every QoS 1
subscription, `--connect-rate` how many devices come online per second (default: all at once).
On 2 cores NATS's JetStream stops between 1,000 and 2,000 devices (benchmarks/docs/scale.md).
Writes scale-cluster.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import queue
import tempfile
import threading
import time
import uuid
from pathlib import Path
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from coordinator.brokers.mosquitto import QUEUE_SETTINGS
from edge_sdk.protocol import Envelope, Kind
from edge_sdk.session import DeviceSession
from edge_sdk.transport import MqttSettings, MqttTransport

from ._brokers import broker, machine_info, raise_fd_limit
from .flags import add_output_flags, add_run_flags

MB = 1_000_000
EXAMPLES = 100


def mosquitto_conf(max_queued: int) -> str:
    """Mosquitto settings for many clients, written out so they are visible: no connection cap
    (this script lifts the open-files limit; Mosquitto inherits it), Mosquitto 2.0's default for
    in-flight QoS 1 messages per client, the per-client queue as `edgepfl broker-config` writes
    it (`--mosquitto-max-queued` other than 0 replaces its limit), and $SYS statistics every
    second (this script reads the count of dropped messages)."""
    queue_lines = [f"max_queued_messages {max_queued}" if line.startswith("max_queued_messages") else line
                   for line in QUEUE_SETTINGS]
    return "\n".join(["max_connections -1", "max_inflight_messages 20", *queue_lines, "sys_interval 1"]) + "\n"


class TinyDevice(DeviceSession):
    """A device that does no work: HELLO, then an update shaped exactly like the broadcast."""

    def hello(self) -> tuple[dict[str, float], dict[str, Any]]:
        return {"num_examples": EXAMPLES}, {"device_type": "trainer", "algorithms": ["fedavg"]}

    def join(self, welcome: Envelope) -> None:
        self.trained = 0

    def handlers(self):
        return {Kind.TRAIN: self._on_train, Kind.EVALUATE: self._on_evaluate}

    def _on_train(self, task: Envelope) -> None:
        if not self.current(task) or self.answered(task):
            return
        self.send(Kind.TRAIN_RES, task.round, request=task, groups=_update_like(task.groups),
                  metrics={"num_examples": EXAMPLES, "loss": 0.0})
        self.trained += 1

    def _on_evaluate(self, request: Envelope) -> None:
        if not self.current(request) or self.answered(request):
            return
        self.send(Kind.EVAL_RES, request.round, request=request, metrics={"accuracy": 0.5, "num_examples": EXAMPLES})


_UPDATES: dict[tuple, dict] = {}
_UPDATES_LOCK = threading.Lock()


def _update_like(groups: dict) -> dict:
    """The "trained" model: a copy of the broadcast (same names, shapes and dtypes, so exactly
    what update_spec asks for), made once per process and shared by its devices, so that cached
    replies do not keep every device's received payload alive."""
    key = tuple((g, k, a.shape, a.dtype.str) for g in sorted(groups) for k, a in sorted(groups[g].items()))
    with _UPDATES_LOCK:
        if key not in _UPDATES:
            _UPDATES[key] = {g: {k: np.array(a) for k, a in arrays.items()} for g, arrays in groups.items()}
        return _UPDATES[key]


def client_id_for(index: int) -> str:
    return f"dev{index:04d}"


def _devices_main(indices: list[int], url: str, protocol: str, federation: str, chunk_size: int, keepalive: int,
                  results, namespace: str | None = None, connect_interval: float = 0.0) -> None:
    """One device process: its devices as threads, each with its own MQTT connection (on the host
    of network namespace `namespace` when given), started `connect_interval` seconds apart (a
    fleet that comes online at a set rate rather than all in the same instant)."""
    if namespace is not None:
        from ._cluster import enter_namespace

        enter_namespace(namespace)
    raise_fd_limit()
    started = time.monotonic()
    settings = MqttSettings(url=url, protocol=protocol, connect_timeout=60, keepalive=keepalive)
    devices = [TinyDevice(client_id_for(i), broker=settings,
                          federation=federation, state_dir="unused", chunk_size=chunk_size) for i in indices]
    errors: list[str] = []

    def run(device: TinyDevice) -> None:
        try:
            device.run()
        except Exception as exc:  # a device that cannot connect is reported, not fatal
            errors.append(f"{device.client_id}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(d,), name=d.client_id, daemon=True) for d in devices]
    connect_started = time.monotonic()
    for thread in threads:
        thread.start()
        if connect_interval:
            time.sleep(connect_interval)  # pacing the connections, not waiting for anything
    connected_at = None
    while connected_at is None and any(t.is_alive() for t in threads):
        if all(cast(MqttTransport, d.channel.transport).connected.is_set() for d in devices):
            connected_at = time.monotonic()
        else:
            time.sleep(0.02)
    for thread in threads:
        thread.join()
    results.put({"devices": len(devices), "process_started_at": started, "connect_started_at": connect_started,
                 "all_connected_at": connected_at, "trained": sum(getattr(d, "trained", 0) for d in devices),
                 "errors": errors, "rejections": sum(sum(d.channel.rejections.values()) for d in devices)})


def _read_status(field: str, pid: int | str = "self") -> int:
    """A /proc/<pid>/status memory field in bytes (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _coordinator_main(config_fields: dict, conn, namespace: str | None = None) -> None:
    """The coordinator process: set up as `edgepfl coordinator` does; its events time the rounds
    and mark when to read its memory. On the host of network namespace `namespace` when given."""
    if namespace is not None:
        from ._cluster import enter_namespace

        enter_namespace(namespace)
    from coordinator.config.run_config import RunConfig
    from coordinator.events import (DevicesRegistered, RegistrationOpened, RoundAggregated, RoundEnded, RoundStarted,
                                    UpdateAccepted)
    from coordinator.memory import return_freed_buffers
    from coordinator.server import Coordinator

    return_freed_buffers()  # as `edgepfl coordinator` does
    config = RunConfig.of(**config_fields)
    assert config.broker.broker is not None, "the coordinator process is given the broker's URL"
    transport = config.coordinator_transport(config.broker.broker)
    transport.connect()
    channel = config.coordinator_channel(transport)
    coordinator = Coordinator(config, channel)
    state = coordinator.algorithm.state
    model_bytes = sum(a.nbytes for group in state.values() for a in group.values())
    model_params = sum(a.size for group in state.values() for a in group.values())
    marks: dict = {"rss_after_start": _read_status("VmRSS"), "reassembly_limits": channel.reassembly_limits}
    rounds: list[dict] = []
    current: dict = {}

    def registration_opened(event: RegistrationOpened) -> None:
        marks["registering_at"] = time.monotonic()
        conn.send(("registering", None))

    def devices_registered(event: DevicesRegistered) -> None:
        marks["registered_at"] = time.monotonic()
        marks["rss_before_round_1"] = _read_status("VmRSS")

    def round_started(event: RoundStarted) -> None:
        current.clear()
        channel.counters.reset_peaks()
        current.update(round=event.round, peak_reset=_reset_peak(), rss_at_begin=_read_status("VmRSS"),
                       began_at=time.monotonic(), accumulated=0, max_backlog=0, max_held_bytes=0,
                       accumulate_seconds=0.0, validation_seconds=0.0)

    def update_accepted(event: UpdateAccepted) -> None:
        current["max_backlog"] = max(current["max_backlog"], transport.incoming.qsize())
        current["max_held_bytes"] = max(current["max_held_bytes"], transport.incoming.held_bytes)
        current.setdefault("first_update_at", event.seconds)
        current["accumulate_seconds"] += event.accumulate_seconds
        current["validation_seconds"] += event.validation_seconds
        current["accumulated"] += 1

    def round_aggregated(event: RoundAggregated) -> None:
        current.update(end_round_seconds=event.seconds, ended_at=time.monotonic(), participants=event.participants,
                       peak_rss_aggregated=_read_status("VmHWM"))

    def round_ended(event: RoundEnded) -> None:
        if "ended_at" not in current:  # not aggregated: the round was aborted (too few updates)
            current["ended_at"] = time.monotonic()
        current.update(peak_rss=_read_status("VmHWM"), rss_at_end=_read_status("VmRSS"),
                       max_pending_blobs=channel.counters.peak_pending_blobs,
                       max_pending_bytes=channel.counters.peak_pending_bytes)
        rounds.append(dict(current))

    subscriptions: list[tuple[Callable[[Any], None], type]] = [
        (registration_opened, RegistrationOpened), (devices_registered, DevicesRegistered),
        (round_started, RoundStarted), (update_accepted, UpdateAccepted),
        (round_aggregated, RoundAggregated), (round_ended, RoundEnded)]
    for callback, kind in subscriptions:
        coordinator.subscribe(callback, kind)
    try:
        report = coordinator.run()
        conn.send(("done", {
            "marks": marks, "rounds": rounds, "model_bytes": model_bytes, "model_params": model_params,
            "report_rounds": report["rounds"], "rejections": report["rejections"],
            "dropped_incoming": transport.dropped_incoming, "flow_control_overruns": transport.incoming.overruns,
            "peak_rss_lifetime": _read_status("VmHWM"), "duplicates": report.get("duplicates_dropped"),
            "wall_seconds": report["wall_seconds"],
        }))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        transport.close()


def _sample_rss(pids: dict[str, int | None], stop: threading.Event, samples: dict[str, list], started: float) -> None:
    """RSS of the coordinator (and the broker or NATS nodes and aggregators, when started here)
    every 50 ms; `samples[name + ":hwm"]` keeps the last high-water mark (VmHWM) read of each,
    the peak between two samples included."""
    import psutil

    processes = {name: psutil.Process(pid) for name, pid in pids.items() if pid is not None}
    while not stop.is_set() and processes:
        now = time.monotonic() - started
        for name, process in list(processes.items()):
            try:
                samples.setdefault(name, []).append((now, process.memory_info().rss))
                samples[name + ":hwm"] = [(now, _read_status("VmHWM", process.pid))]
            except (psutil.Error, OSError):
                del processes[name]
        stop.wait(0.05)


def broker_dropped(url: str, protocol: str) -> int | None:
    """Mosquitto's $SYS count of messages it dropped (queues full), or None if not published."""
    from edge_sdk.transport import MqttTransport

    transport = MqttTransport(f"scale-sys-{uuid.uuid4().hex[:6]}", MqttSettings(url=url, protocol=protocol))
    try:
        transport.connect()
        transport.subscribe("$SYS/broker/publish/messages/dropped", qos=0)
        message = transport.incoming.get(timeout=3)
        return int(bytes(message.payload))
    except (queue.Empty, ValueError, OSError):
        return None
    finally:
        transport.close()


def run_scale(devices: int, running, args, workdir: Path, cluster=None) -> dict:
    """One device count through one broker (`running`), or, with `cluster` (_cluster.Cluster),
    through its NATS nodes: the coordinator on host 1 with `--shards`, the aggregators on hosts 2
    and 3, device process w on host w % 3 + 1, each connected to its own host's node."""
    url, protocol, broker_pid = running
    federation = f"scale{devices}-{uuid.uuid4().hex[:6]}"
    processes = args.processes or max(1, min(16, math.ceil(devices / 125)))
    shards = args.shards if cluster is not None else 0
    sharding = {"shards": shards} if shards else {}
    config = dict(algorithm="fedavg", dataset=args.dataset, model=args.model, clients=devices, rounds=args.rounds,
                  eval_every=args.rounds, min_clients=devices, quorum_grace=0.0, round_timeout=args.round_timeout,
                  registration_timeout=args.registration_timeout, federation=federation, broker=url,
                  mqtt_protocol=protocol, out=str(workdir / federation), seed=0, **sharding, **args.library)
    dropped_before = broker_dropped(url, protocol) if cluster is None else None
    pids = {"broker": broker_pid}
    if cluster is not None:
        from ._cluster import host_of_process

        (workdir / federation).mkdir(parents=True, exist_ok=True)
        cluster.start_aggregators(shards, federation, workdir / federation)
        pids = {**cluster.node_pids, **{f"aggregator-{k}": p.pid for k, (p, _) in enumerate(cluster.aggregators)}}
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    coordinator = context.Process(target=_coordinator_main, name="coordinator", daemon=True,
                                  args=(config, child, cluster.namespace(1) if cluster is not None else None))
    coordinator.start()
    samples: dict[str, list] = {}
    stop = threading.Event()
    started = time.monotonic()
    sampler = threading.Thread(target=_sample_rss, daemon=True,
                               args=({"coordinator": coordinator.pid, **pids}, stop, samples, started))
    sampler.start()
    results = context.Queue()
    workers: list = []
    try:
        if not parent.poll(120):
            raise RuntimeError("the coordinator did not start within 120 s")
        message, detail = parent.recv()
        if message != "registering":
            raise RuntimeError(f"coordinator: {detail}")
        devices_started = time.monotonic()
        for w in range(processes):
            host = host_of_process(w) if cluster is not None else None
            worker = context.Process(target=_devices_main, daemon=True,
                                     args=(list(range(w, devices, processes)),
                                           cluster.url(host) if cluster is not None else url, protocol, federation,
                                           args.upload_chunk_size, args.device_keepalive, results,
                                           cluster.namespace(host) if cluster is not None else None,
                                           processes / args.connect_rate if args.connect_rate else 0.0))
            worker.start()
            workers.append(worker)
        limit = args.registration_timeout + args.rounds * args.round_timeout * 2 + 120
        deadline = time.monotonic() + limit
        while not parent.poll(1.0):  # this process holds the pipe's other end too: no EOF if the coordinator dies
            if not coordinator.is_alive():
                raise RuntimeError(f"the coordinator process exited (code {coordinator.exitcode}) without a result")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not finish within {limit:.0f} s")
        message, detail = parent.recv()
        if message != "done":
            raise RuntimeError(f"coordinator: {detail}")
        try:
            device_stats = [results.get(timeout=60) for _ in workers]
        except queue.Empty:  # devices that never heard the run finish (e.g. their broker dropped them)
            raise RuntimeError("a device process did not finish within 60 s of the coordinator") from None
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
        coordinator.join(timeout=30)
        if coordinator.is_alive():
            coordinator.terminate()
        aggregator_logs = cluster.stop_aggregators() if cluster is not None else []
    dropped_after = broker_dropped(url, protocol) if cluster is None else None
    summary = summarize(devices, processes, detail, device_stats, devices_started, samples.get("coordinator", []),
                        started)
    if cluster is not None:
        summary.update(cluster_summary(summary, samples, detail, started, aggregator_logs))
    broker_rss = [rss for _, rss in samples.get("broker", [])]
    summary["broker_peak_rss_bytes"] = max(broker_rss) if broker_rss else None
    summary["broker_rss_before_bytes"] = broker_rss[0] if broker_rss else None
    summary["broker_dropped_messages"] = (dropped_after - dropped_before
                                          if dropped_after is not None and dropped_before is not None else None)
    return summary


def summarize(devices: int, processes: int, detail: dict, device_stats: list[dict], devices_started: float,
              samples: list, started: float) -> dict:
    marks, model_bytes = detail["marks"], detail["model_bytes"]
    baseline = marks["rss_before_round_1"]
    records = {r["round"]: r for r in detail["report_rounds"]}
    rounds = []
    for r in detail["rounds"]:
        record = records.get(r["round"], {})
        rounds.append({
            "round": r["round"],
            "participants": record.get("participants"),
            "outcome": record.get("outcome"),
            # sharded, the coordinator folds no update itself: the round's participants are the updates in the partials
            "updates_accepted": r.get("accumulated") or r.get("participants", 0),
            "all_updates_received": (r.get("accumulated") or r.get("participants", 0)) == devices,
            "lost_updates": record.get("lost_updates"),
            "lost_shards": record.get("lost_shards"),
            "latency_seconds": r["ended_at"] - r["began_at"],
            "first_update_after_seconds": r.get("first_update_at"),
            "aggregation_seconds": r.get("accumulate_seconds", 0.0) + r.get("end_round_seconds", 0.0),
            "accumulate_seconds": r.get("accumulate_seconds", 0.0),
            "end_round_seconds": r.get("end_round_seconds", 0.0),
            "validation_seconds": r.get("validation_seconds", 0.0),
            "coordinator_round_seconds": record.get("seconds"),
            "peak_rss_bytes": r["peak_rss"],
            "peak_over_baseline_over_model_until_aggregated": (r["peak_rss_aggregated"] - baseline) / model_bytes
            if "peak_rss_aggregated" in r else None,
            "rss_at_begin_bytes": r["rss_at_begin"],
            "rss_at_end_bytes": r["rss_at_end"],
            "round_growth_over_model": (r["peak_rss"] - r["rss_at_begin"]) / model_bytes,
            "peak_over_baseline_over_model": (r["peak_rss"] - baseline) / model_bytes,
            "peak_measured": r["peak_reset"],
            "max_incoming_backlog": r["max_backlog"],
            "max_held_bytes": r["max_held_bytes"],
            "max_pending_blobs": r.get("max_pending_blobs", 0),
            "max_pending_reassembly_bytes": r.get("max_pending_bytes", 0),
            "bytes_up": record.get("bytes_up"),
            "bytes_down": record.get("bytes_down"),
            "rejections": record.get("rejections"),
        })
    connected = [s["all_connected_at"] for s in device_stats if s["all_connected_at"] is not None]
    worst = max((r["peak_over_baseline_over_model"] for r in rounds), default=None)
    return {
        "devices": devices,
        "device_processes": processes,
        "model_params": detail["model_params"],
        "model_bytes": model_bytes,
        "registration_seconds": marks["registered_at"] - devices_started,
        "registration_after_first_connect_seconds":
            marks["registered_at"] - min(s["connect_started_at"] for s in device_stats),
        "all_connected_seconds": (max(connected) - devices_started) if len(connected) == len(device_stats) else None,
        "reassembly_limits": marks["reassembly_limits"],
        "rss_after_start_bytes": marks["rss_after_start"],
        "rss_before_round_1_bytes": baseline,
        "peak_rss_bytes": max((r["peak_rss_bytes"] for r in rounds), default=None),
        "peak_over_baseline_over_model": worst,
        "rounds": rounds,
        "all_updates_received": bool(rounds) and all(r["all_updates_received"] for r in rounds),
        "rejections": detail["rejections"],
        "dropped_incoming": detail["dropped_incoming"],
        "flow_control_overruns": detail["flow_control_overruns"],
        "device_errors": [e for s in device_stats for e in s["errors"]][:20],
        "device_rejections": sum(s["rejections"] for s in device_stats),
        "updates_sent": sum(s["trained"] for s in device_stats),
        "coordinator_wall_seconds": detail["wall_seconds"],
        "rss_samples": [(round(t - (devices_started - started), 3), rss)
                        for t, rss in samples[::max(1, len(samples) // 2000)]],
    }


def cluster_summary(summary: dict, samples: dict[str, list], detail: dict, started: float,
                    aggregator_logs: list[str]) -> dict:
    """The aggregators' and NATS nodes' memory: each one's peak (VmHWM, read every 50 ms while it
    runs, so its last read is within 50 ms of its end) and RSS when every device had registered;
    an aggregator's peak above that RSS as a multiple of the model's size."""
    registered = detail["marks"]["registered_at"] - started
    model_bytes = summary["model_bytes"]

    def memory(name: str) -> dict:
        series = samples.get(name, [])
        before = [rss for t, rss in series if t <= registered]
        hwm = samples.get(name + ":hwm", [(0, None)])[-1][1]
        peak = max(hwm or 0, max((rss for _, rss in series), default=0)) or None
        base = before[-1] if before else None
        return {"peak_rss_bytes": peak, "rss_registered_bytes": base,
                "peak_over_registered_over_model": (peak - base) / model_bytes if peak and base else None}

    aggregators = sorted(name for name in samples if name.startswith("aggregator-") and ":" not in name)
    nodes = sorted(name for name in samples if name.startswith("nats-") and ":" not in name)
    return {"aggregators": [{"name": name, **memory(name), "last_log_line": line}
                            for name, line in zip(aggregators, aggregator_logs, strict=False)],
            "nats_nodes": [{"name": name, **memory(name)} for name in nodes]}


def markdown(result: dict) -> str:
    s = result["settings"]
    replicas = s.get("nats_consumer_replicas") or "3 (the stream's)"
    storage = "in memory" if s.get("nats_consumer_memory") else "on disk"
    cluster_note = (f" ({s['shards']} shard aggregators; the JetStream consumer of each QoS 1 subscription: "
                    f"{replicas} replicas, {storage})") if s.get("cluster") else ""
    completed = [run for run in result["runs"] if "error" not in run]  # a failed run has only its error
    lines = [f"fedavg, model {s['model']} ({completed[0]['model_params'] if completed else '?'} parameters), "
             f"{s['rounds']} rounds, broadcast chunk size {s['chunk_size']} bytes, upload chunk size "
             f"{s['upload_chunk_size']} bytes, flow control {s['flow_control_bytes']} bytes, broker {s['broker']}"
             + cluster_note + "; "
             "memory: coordinator RSS over the whole round (broadcast to checkpoint), as multiples of the "
             "model's bytes",
             "",
             "| devices | register all s | round | updates accepted | round latency s | aggregation s | validation s "
             "| peak RSS MB | round growth / model | peak over baseline / model | incoming backlog | held MB "
             "| pending blobs | rejections | all received |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        if "error" in run:
            lines.append(f"| {run['devices']} | failed: {run['error']} ||||||||||||||")
            continue
        for r in run["rounds"]:
            lines.append(
                f"| {run['devices']} | {run['registration_seconds']:.1f} | {r['round']} | {r['updates_accepted']} "
                f"| {r['latency_seconds']:.2f} | {r['aggregation_seconds']:.3f} | {r['validation_seconds']:.3f} "
                f"| {r['peak_rss_bytes'] / MB:.0f} | {r['round_growth_over_model']:.2f} "
                f"| {r['peak_over_baseline_over_model']:.2f} | {r['max_incoming_backlog']} "
                f"| {r['max_held_bytes'] / MB:.1f} | {r['max_pending_blobs']} "
                f"| {', '.join(f'{k} {v}' for k, v in (r['rejections'] or {}).items()) or '-'} "
                f"| {'yes' if r['all_updates_received'] else 'NO'} |")
    t = result["targets"]
    lines += ["", "## Targets", ""]
    if t["largest_devices"] is None:
        lines.append("- no run completed")
    else:
        lines += [
            f"- coordinator memory at {t['largest_devices']} devices: "
            f"peak {t['peak_over_baseline_over_model']:.2f}x the model "
            f"above the RSS before round 1 (target <= 3x): {'met' if t['memory_met'] else 'missed'}",
            f"- every update received at every device count and round: {'yes' if t['no_update_lost'] else 'NO'}",
        ]
    if s.get("cluster"):
        lines += ["", "## Cluster: aggregators and NATS nodes", "",
                  "| devices | process | peak RSS MB | RSS when registered MB | peak over registered / model |",
                  "|---|---|---|---|---|"]
        for run in result["runs"]:
            for process in run.get("aggregators", []) + run.get("nats_nodes", []):
                over = process["peak_over_registered_over_model"]
                lines.append(f"| {run['devices']} | {process['name']} | {(process['peak_rss_bytes'] or 0) / MB:.0f} "
                             f"| {(process['rss_registered_bytes'] or 0) / MB:.0f} "
                             f"| {'-' if over is None else f'{over:.2f}'} |")
    lines += ["", f"machine: {result['machine']['cpu_model']}, {result['machine']['cores']} cores, "
              "load average at start "
              f"{result['machine']['load_average_at_start']}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in result["runs"]:
        if run.get("rss_samples"):
            t, rss = zip(*run["rss_samples"], strict=True)
            ax.plot(t, [(x - run["rss_before_round_1_bytes"]) / run["model_bytes"] for x in rss],
                    label=f"{run['devices']} devices")
    ax.axhline(3, color="grey", linestyle="--", linewidth=1, label="target: 3x the model")
    ax.set(xlabel="seconds since the device processes started",
           ylabel="coordinator RSS - RSS before round 1 (models)", title="Coordinator memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_on_cluster(devices: int, args, workdir: Path) -> dict:
    """One device count on a fresh cluster (hosts, NATS nodes with empty JetStream stores), so
    that the nodes' memory is this count's."""
    from ._cluster import cluster, mqtt_options

    extra = mqtt_options(args.nats_consumer_replicas, args.nats_consumer_memory)
    with cluster(workdir / f"cluster{devices}", mqtt_extra=extra) as running:
        return run_scale(devices, (running.url(1), "3.1.1", None), args, workdir, cluster=running)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "20 and 50 devices, 2 rounds, cnn8")
    parser.add_argument("--broker", help="mqtt://host:port (default: start Mosquitto with the config written here)")
    parser.add_argument("--devices", help="comma-separated device counts (default 100,500,1000; quick 20,50)")
    parser.add_argument("--processes", type=int, default=0, help="device processes (default: one per 125 devices)")
    parser.add_argument("--device-keepalive", type=int, default=300,
                        help="MQTT keepalive of the simulated devices in seconds (default 300, not the SDK's 30: "
                             "hundreds of devices share a few cores here, so a device's PINGRESP can wait behind "
                             "megabytes of broadcast its process has not read yet; a real device has its own CPU)")
    parser.add_argument("--mosquitto-max-queued", type=int, default=0,
                        help="Mosquitto's max_queued_messages per client (default 0, no limit, as `edgepfl "
                             "broker-config` writes it; Mosquitto's own default is 1000)")
    parser.add_argument("--cluster", action="store_true",
                        help="three hosts (network namespaces, root) with a NATS node each, the coordinator on host 1 "
                             "with --shards, aggregators on hosts 2 and 3, the devices over all three (default "
                             "500,2000,5000,10000 devices, 1 round, mlp on digits: 26,122 parameters, 104 KB; quick: "
                             "30 devices)")
    parser.add_argument("--shards", type=int, default=2, help="--cluster: shard aggregators (default 2)")
    parser.add_argument("--connect-rate", type=float, default=0.0,
                        help="devices connecting per second, over all device processes (default 0: all at once)")
    parser.add_argument("--nats-consumer-replicas", type=int,
                        help="--cluster: replicas of the JetStream consumer NATS makes per QoS 1 subscription "
                             "(default: the stream's, 3: every subscription is a 3-node Raft group)")
    parser.add_argument("--nats-consumer-memory", action="store_true",
                        help="--cluster: NATS keeps those consumers in memory, not on disk")
    add_run_flags(parser, ("dataset", "model", "rounds", "round_timeout", "registration_timeout", "chunk_size",
                           "upload_chunk_size", "flow_control_bytes"),
                  {"dataset": None, "model": None, "rounds": None, "round_timeout": 180.0,
                   "registration_timeout": 300.0, "chunk_size": None, "upload_chunk_size": None,
                   "flow_control_bytes": None}, broker=False)
    parser.epilog = (parser.epilog or "") + (
        " --rounds: per device count, default 2 (--cluster 1); --dataset (it sizes the model): default cifar100, "
        "--quick and --cluster digits; --model: default cnn32 (0.92M parameters on cifar100), --quick cnn8, "
        "--cluster mlp; a lost update shows as a round --round-timeout long.")
    args = parser.parse_args()
    if args.cluster:
        from ._cluster import unavailable

        if (reason := unavailable()) is not None:
            print(f"skipped: {reason}")
            return
        if args.broker:
            parser.error("--cluster starts its own NATS nodes; --broker does not apply")
    default_devices = ("30" if args.quick else "500,2000,5000,10000") if args.cluster else \
        ("20,50" if args.quick else "100,500,1000")
    args.devices = [int(n) for n in (args.devices or default_devices).split(",")]
    args.rounds = args.rounds or (1 if args.cluster else 2)
    args.dataset = args.dataset or ("digits" if args.quick or args.cluster else "cifar100")
    args.model = args.model or ("mlp" if args.cluster else "cnn8" if args.quick else "cnn32")
    if args.quick:
        args.round_timeout = min(args.round_timeout, 60.0)
        args.registration_timeout = min(args.registration_timeout, 60.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fd_limit = raise_fd_limit()
    conf = mosquitto_conf(args.mosquitto_max_queued)
    from coordinator.config.run_config import RunConfig

    args.library = {key: getattr(args, key) for key in ("chunk_size", "upload_chunk_size", "flow_control_bytes")
                    if getattr(args, key) is not None}
    library = RunConfig.of(**args.library)
    args.upload_chunk_size = library.broker.upload_chunk_size
    result: dict = {"machine": machine_info(),
                    "settings": {"quick": args.quick, "devices": args.devices, "rounds": args.rounds,
                                 "dataset": args.dataset, "model": args.model, "chunk_size": library.broker.chunk_size,
                                 "upload_chunk_size": library.broker.upload_chunk_size,
                                 "flow_control_bytes": library.broker.flow_control_bytes,
                                 "round_timeout": args.round_timeout,
                                 "broker": "nats cluster (3 nodes)" if args.cluster else args.broker or "mosquitto",
                                 "cluster": args.cluster, "shards": args.shards if args.cluster else 0,
                                 "nats_consumer_replicas": args.nats_consumer_replicas,
                                 "nats_consumer_memory": args.nats_consumer_memory,
                                 "device_keepalive": args.device_keepalive, "connect_rate": args.connect_rate,
                                 "mosquitto_conf": None if args.broker or args.cluster else conf,
                                 "open_files_limit": list(fd_limit)},
                    "runs": []}
    with tempfile.TemporaryDirectory(prefix="edgepfl-scale-") as workdir, contextlib.ExitStack() as stack:
        running = None if args.cluster else stack.enter_context(
            broker(args.broker or "mosquitto", Path(workdir), mosquitto_extra=conf))
        for devices in args.devices:
            try:
                run = (run_on_cluster(devices, args, Path(workdir)) if args.cluster
                       else run_scale(devices, running, args, Path(workdir)))
            except (RuntimeError, OSError, EOFError, AssertionError) as exc:
                run = {"devices": devices, "error": f"{type(exc).__name__}: {exc}"}
            result["runs"].append(run)
            rounds = run.get("rounds", [])
            print(f"{devices} devices: " + (run["error"] if "error" in run else
                  f"registered in {run['registration_seconds']:.1f} s; rounds " + ", ".join(
                      f"{r['latency_seconds']:.2f} s ({r['updates_accepted']}/{devices}, "
                      f"peak +{r['peak_over_baseline_over_model']:.2f} models)"
                      for r in rounds)), flush=True)
    done = [r for r in result["runs"] if "error" not in r]
    largest = max(done, key=lambda r: r["devices"]) if done else None
    result["targets"] = {
        "largest_devices": largest["devices"] if largest else None,
        "peak_over_baseline_over_model": largest["peak_over_baseline_over_model"] if largest else None,
        "memory_max_models": 3.0,
        "memory_met": largest is not None and (largest["peak_over_baseline_over_model"] or math.inf) <= 3.0,
        "no_update_lost": bool(done) and len(done) == len(result["runs"])
        and all(r["all_updates_received"] for r in done),
    }
    stem = "scale-cluster" if args.cluster else "scale"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(markdown(result))
    plot(result, out / f"{stem}.png")
    print(markdown(result))


if __name__ == "__main__":
    main()

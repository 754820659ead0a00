"""Wire and MQTT transport throughput: encode/decode MB/s, payloads through Mosquitto and amqtt.

Full run (about a minute; Mosquitto installed):

    python -m benchmarks.transport --out benchmarks/results

Quick (a smoke test, well under a minute): `python -m benchmarks.transport --quick --out DIR`.
`--broker mqtt://host:port` measures an existing broker instead of starting Mosquitto and amqtt.

What it measures (MB = 10^6 bytes of raw float32 tensor data; arrays in a ResNet-like layout of
conv, BatchNorm and linear shapes, so many arrays of model-like sizes, not one big blob):

1. `wire`: `edge_sdk.wire.encode` / `decode` throughput for envelopes of 1, 10 and 100 MB, plus
   the chunking pieces a transfer also pays for (`chunk_frames` at 1 MiB, sha256, reassembly).
2. `transfers`: one envelope sent from a `Channel` over `MqttTransport` in this process to a
   `Channel` in a receiver process through the broker, for payloads of 1, 10, 50 and 100 MB,
   chunked at 1 MiB (the default) and 128 KiB, and "unchunked" (chunk size = MAX_CHUNK_SIZE,
   64 MiB: payloads up to 64 MiB travel as one MQTT message; 100 MB still travels as 2). The time
   runs from the `Channel.send` call (encoding included) to the decoded envelope returned by the
   receiver's `Channel.receive` (`seconds`, `mb_per_s`); `publish_mb_per_s` starts the clock at
   the first MQTT publish instead (after encoding and chunking). Each transfer records a
   timeline: encode, chunk, publish calls, first/last frame arriving at the receiver, frame
   unpacking, reassembly (sha256 as the frames arrive, the join at the last), decode. `raw` rows
   publish the same frames with no Channel on either side (paho + broker alone). The median of
   `--repeats` runs is reported. `--sizes 50 --chunk-sizes 1048576` measures one case.
3. `wire_overhead_ratio`: the largest (bytes the sender's ByteCounter counted: payload + topic,
   chunk headers included) / (raw tensor bytes) over all payloads of at least 1 MB.

Writes transport.json, transport.md and transport.png to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import zlib
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

import numpy as np

import edge_sdk.channel as channel_module
from edge_sdk import wire
from edge_sdk.channel import Channel
from edge_sdk.chunks import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, Reassembler, chunk_frames, chunk_from_dict
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

from ._brokers import broker, machine_info

MB = 1_000_000
FEDERATION = "bench"
TOPIC = Topics(FEDERATION).broadcast(Kind.TRAIN)

# ResNet-18-like layer shapes (conv weights, BatchNorm weight/bias, a linear layer), repeated
# until the payload is full; the last array is cut to hit the exact size.
_LAYOUT: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
for _c_in, _c_out in ((64, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 512), (512, 512)):
    _LAYOUT += [(_c_out, _c_in, 3, 3), (_c_out,), (_c_out,), (_c_out, _c_out, 3, 3), (_c_out,), (_c_out,)]
_LAYOUT += [(1000, 512), (1000,)]


def model_like_arrays(nbytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 arrays in the layout above totalling exactly `nbytes` (a multiple of 4)."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    left = nbytes // 4
    index = 0
    while left > 0:
        shape = _LAYOUT[index % len(_LAYOUT)]
        size = int(np.prod(shape))
        if size > left:
            shape, size = (left,), left
        arrays[f"layer{index // len(_LAYOUT)}.{index % len(_LAYOUT):02d}"] = (
            rng.standard_normal(size, dtype=np.float32).reshape(shape))
        left -= size
        index += 1
    return arrays


def envelope_of(arrays: dict[str, np.ndarray]) -> Envelope:
    return Envelope(Kind.TRAIN, COORDINATOR, run_id="bench", round=1, groups={"shared": arrays},
                    config={"selected": ["receiver"]})


def checksum(groups: dict[str, dict[str, np.ndarray]]) -> tuple[int, int, int]:
    """(arrays, bytes, crc32 over all arrays in name order): to check what arrived."""
    crc, count, size = 0, 0, 0
    for group in sorted(groups):
        for key in sorted(groups[group]):
            data = np.ascontiguousarray(groups[group][key]).view(np.uint8).reshape(-1)
            crc = zlib.crc32(data.data, crc)
            count += 1
            size += data.size
    return count, size, crc


def _reassemble(frames: list[bytes], size: int) -> None:
    """Reassemble `frames` as the coordinator does; the blob must be `size` bytes."""
    assembler = Reassembler(max_blob_bytes=1 << 30, max_pending_bytes=1 << 31)
    blob = None
    for frame in frames:
        blob = assembler.add(TOPIC, chunk_from_dict(wire.unpack(frame)))
    assert blob is not None and len(blob) == size


def _sha256(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


def _timeit(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


# -- 1. wire -------------------------------------------------------------------------------
def bench_wire(sizes_mb: list[int], repeats: int) -> list[dict]:
    rows = []
    for size_mb in sizes_mb:
        arrays = model_like_arrays(size_mb * MB)
        envelope = envelope_of(arrays)
        raw = envelope.array_bytes()
        payload = wire.encode(envelope)
        frames = chunk_frames(payload, DEFAULT_CHUNK_SIZE)
        times = {
            "encode": _timeit(partial(wire.encode, envelope), repeats),
            "decode": _timeit(partial(wire.decode, payload), repeats),
            "chunk_frames_1mib": _timeit(partial(chunk_frames, payload, DEFAULT_CHUNK_SIZE), repeats),
            "reassemble_1mib": _timeit(partial(_reassemble, frames, len(payload)), repeats),
            "sha256": _timeit(partial(_sha256, payload), repeats),
        }
        row: dict[str, float] = {"payload_mb": size_mb, "raw_bytes": raw, "arrays": len(arrays),
                                 "encoded_bytes": len(payload),
                                 "chunked_bytes_1mib": sum(len(f) for f in frames) + len(frames) * len(TOPIC)}
        for name, values in times.items():
            median = statistics.median(values)
            row[f"{name}_seconds"] = median
            row[f"{name}_mb_per_s"] = raw / median / MB
        rows.append(row)
        print(f"wire {size_mb:>4} MB: encode {row['encode_mb_per_s']:8.0f} MB/s, "
              f"decode {row['decode_mb_per_s']:8.0f} MB/s, chunk {row['chunk_frames_1mib_mb_per_s']:6.0f} MB/s, "
              f"reassemble {row['reassemble_1mib_mb_per_s']:6.0f} MB/s",
              flush=True)
    return rows


def overhead_rows(sizes_mb: list[int], chunk_sizes: list[int]) -> list[dict]:
    """Bytes a sender's ByteCounter counts (payload + topic per frame) per raw tensor byte,
    computed from the same code path as Channel.send without a broker."""
    rows = []
    for size_mb in sizes_mb:
        envelope = envelope_of(model_like_arrays(size_mb * MB))
        payload = wire.encode(envelope)
        for chunk_size in chunk_sizes:
            frames = [payload] if len(payload) <= chunk_size else chunk_frames(payload, chunk_size)
            counted = sum(len(f) + len(TOPIC) for f in frames)
            rows.append({"payload_mb": size_mb, "chunk_size": chunk_size, "frames": len(frames),
                         "raw_bytes": envelope.array_bytes(), "wire_bytes": counted,
                         "ratio": counted / envelope.array_bytes()})
    return rows


# -- 2. transfers: the receiver process ----------------------------------------------------
class _Timers:
    """Accumulated seconds per instrumented function, reset per transfer."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.last: dict[str, float] = {}
        self.first_frame: float | None = None
        self.last_frame: float | None = None
        self.frames = 0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.seconds[name] += elapsed
                self.calls[name] += 1
                self.last[name] = elapsed

        return timed

    def wrap_completing(self, name: str, completing: str, fn):
        """Like `wrap` for `Reassembler.add`: the calls that complete a blob (they return it, joined
        once its sha256 matches) are timed under `completing`, the others (each hashing its chunk
        where the ones before it are in) under `name`."""
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            self.seconds[completing if result is not None else name] += time.perf_counter() - started
            return result

        return timed

    def wrap_iter(self, name: str, fn):
        """Like `wrap` for a generator function: times the work of every item it yields."""
        def timed(*args, **kwargs):
            iterator = fn(*args, **kwargs)
            while True:
                started = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    self.seconds[name] += time.perf_counter() - started
                yield item

        return timed

    def frame_arrived(self) -> None:
        now = time.monotonic()
        if self.first_frame is None:
            self.first_frame = now
        self.last_frame = now
        self.frames += 1


def _receiver_main(url: str, protocol: str, chunk_size: int, conn) -> None:
    """Receive envelopes (or raw frames) on TOPIC and report a timeline for each. The functions
    timed are replaced by timed wrappers in this process (monkeypatched on purpose)."""
    timers = _Timers()
    wire.unpack = timers.wrap("unpack", wire.unpack)
    wire.envelope_from_dict = timers.wrap("envelope_from_dict", wire.envelope_from_dict)
    channel_module.chunk_from_dict = timers.wrap("chunk_from_dict", channel_module.chunk_from_dict)
    Reassembler.add = timers.wrap_completing(  # type: ignore[method-assign]
        "reassembler_add", "reassembler_complete", Reassembler.add)

    transport = MqttTransport("bench.receiver", MqttSettings(url=url, protocol=protocol), max_queue=100_000)
    record = transport.counter.record

    def counted(direction: str, topic: str, payload_len: int) -> None:
        if direction == "received":
            timers.frame_arrived()
        record(direction, topic, payload_len)

    transport.counter.record = counted  # type: ignore[method-assign]
    transport.connect()
    channel = Channel(transport, Topics(FEDERATION), chunk_size=chunk_size)
    transport.subscribe(TOPIC)
    conn.send(("ready", transport.protocol))
    # Counted from the end of the previous transfer, as the timers are: the sender starts as soon as the
    # command is sent, and on a busy machine its first frames can arrive before this process reads it.
    received0 = transport.counter.total("received")
    try:
        while True:
            command = conn.recv()
            if command[0] == "stop":
                return
            if command[0] == "raw":
                _, frames, timeout = command
                deadline = time.monotonic() + timeout
                got = 0
                while got < frames and time.monotonic() < deadline:
                    try:
                        transport.incoming.get(timeout=max(0.0, deadline - time.monotonic()))
                        got += 1
                    except Exception:
                        break
                done = time.monotonic()
                result = {"ok": got == frames, "frames": got}
            else:
                _, timeout = command
                received = channel.receive(timeout)
                done = time.monotonic()
                result = {"ok": received is not None, "rejections": dict(channel.rejections)}
                if received is not None:
                    result["checksum"] = checksum(received.envelope.groups)
            chunked = timers.calls["chunk_from_dict"] > 0
            unpack_last = timers.last.get("unpack", 0.0)
            result.update({
                "done_at": done,
                "first_frame_at": timers.first_frame,
                "last_frame_at": timers.last_frame,
                "frames_received": timers.frames,
                "received_bytes": transport.counter.total("received") - received0,
                "frame_unpack_seconds": timers.seconds["unpack"] - (unpack_last if chunked else 0.0)
                + timers.seconds["chunk_from_dict"],
                "reassembly_store_seconds": timers.seconds["reassembler_add"],
                "reassembly_join_sha256_seconds": timers.seconds["reassembler_complete"],
                "decode_seconds": (unpack_last if chunked else timers.seconds["unpack"])
                + timers.seconds["envelope_from_dict"],
                "dropped_incoming": transport.dropped_incoming,
            })
            timers.reset()
            received0 = transport.counter.total("received")
            conn.send(result)
    finally:
        transport.close()


class _Sender:
    """The sending side, instrumented the same way (encode, chunking, publish calls)."""

    def __init__(self, url: str, protocol: str, chunk_size: int):
        self.timers = _Timers()
        self.transport = MqttTransport("bench.sender", MqttSettings(url=url, protocol=protocol))
        self.transport.connect()
        self.channel = Channel(self.transport, Topics(FEDERATION), chunk_size=chunk_size)
        publish = self.transport.publish
        self.first_publish: float | None = None

        def timed_publish(topic: str, payload: bytes | bytearray | memoryview, **kwargs) -> None:
            if self.first_publish is None:
                self.first_publish = time.monotonic()
            started = time.perf_counter()
            publish(topic, payload, **kwargs)
            self.timers.seconds["publish"] += time.perf_counter() - started
            self.timers.calls["publish"] += 1

        self.transport.publish = timed_publish  # type: ignore[method-assign]

    def send(self, envelope: Envelope) -> dict:
        encode, frames = wire.encode_pieces, channel_module.iter_frames
        wire.encode_pieces = self.timers.wrap("encode", encode)
        channel_module.iter_frames = self.timers.wrap_iter("chunk_frames", frames)
        self.timers.reset()
        self.first_publish = None
        sent0 = self.transport.counter.total("sent")
        try:
            started = time.monotonic()
            self.channel.send(TOPIC, envelope)
            returned = time.monotonic()
        finally:
            wire.encode_pieces, channel_module.iter_frames = encode, frames
        return {"started_at": started, "send_returned_at": returned, "first_publish_at": self.first_publish,
                "encode_seconds": self.timers.seconds["encode"], "chunk_seconds": self.timers.seconds["chunk_frames"],
                "publish_calls_seconds": self.timers.seconds["publish"], "frames_sent": self.timers.calls["publish"],
                "sent_bytes": self.transport.counter.total("sent") - sent0}

    def send_raw(self, frames: list[bytes]) -> dict:
        self.first_publish = None
        started = time.monotonic()
        for frame in frames:
            self.transport.publish(TOPIC, frame)
        return {"started_at": started, "send_returned_at": time.monotonic(), "first_publish_at": self.first_publish}

    def close(self) -> None:
        self.transport.close()


def _timeline(sent: dict, got: dict, raw_bytes: int) -> dict:
    t0 = sent["started_at"]
    rel = lambda t: None if t is None else t - t0  # noqa: E731
    seconds = got["done_at"] - t0
    from_publish = got["done_at"] - sent["first_publish_at"]
    return {
        **{k: v for k, v in sent.items() if k.endswith("_seconds") or k in ("frames_sent", "sent_bytes")},
        **{k: v for k, v in got.items() if k.endswith("_seconds") or k in ("frames_received", "received_bytes",
                                                                          "dropped_incoming")},
        "seconds": seconds,
        "mb_per_s": raw_bytes / seconds / MB,
        "publish_seconds": from_publish,
        "publish_mb_per_s": raw_bytes / from_publish / MB,
        "first_publish_at": rel(sent["first_publish_at"]),
        "send_returned_at": rel(sent["send_returned_at"]),
        "first_frame_at": rel(got["first_frame_at"]),
        "last_frame_at": rel(got["last_frame_at"]),
        "after_last_frame_seconds": None if got["last_frame_at"] is None else got["done_at"] - got["last_frame_at"],
    }


def bench_transfers(broker_name: str, url: str, protocol: str, chunk_size: int, sizes_mb: list[int], repeats: int,
                    timeout: float, raw_sizes_mb: list[int]) -> list[dict]:
    """All payload sizes for one (broker, chunk size): one receiver process, one sender."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    receiver = context.Process(target=_receiver_main, args=(url, protocol, chunk_size, child), daemon=True)
    receiver.start()
    rows: list[dict] = []
    sender = None
    try:
        if not parent.poll(60):
            raise RuntimeError("the receiver did not connect within 60 s")
        _, used_protocol = parent.recv()
        sender = _Sender(url, protocol, chunk_size)
        # warm-up: also proves the receiver's subscription is active
        for _ in range(3):
            parent.send(("envelope", 5.0))
            sender.send(envelope_of(model_like_arrays(4096)))
            if parent.recv()["ok"]:
                break
        else:
            raise RuntimeError("warm-up message never arrived")
        for size_mb in sizes_mb:
            arrays = model_like_arrays(size_mb * MB)
            raw_bytes = sum(a.nbytes for a in arrays.values())
            expected = checksum({"shared": arrays})
            base = {"broker": broker_name, "protocol": used_protocol, "chunk_size": chunk_size, "payload_mb": size_mb,
                    "raw_bytes": raw_bytes, "arrays": len(arrays), "mode": "channel"}
            runs = []
            for _ in range(repeats):
                parent.send(("envelope", timeout))
                sent = sender.send(envelope_of(arrays))
                if not parent.poll(timeout + 30):
                    raise TimeoutError(f"{broker_name}: no answer from the receiver for {size_mb} MB")
                got = parent.recv()
                if not got["ok"] or tuple(got["checksum"]) != expected:
                    runs.append({"error": "not received" if not got["ok"] else "checksum mismatch",
                                 "rejections": got.get("rejections"), "seconds": got["done_at"] - sent["started_at"]})
                    break
                runs.append(_timeline(sent, got, raw_bytes))
            rows.append(_summarize(base, runs))
            _print_row(rows[-1])
            if "error" in rows[-1]:
                break
        for size_mb in raw_sizes_mb:
            payload = wire.encode(envelope_of(model_like_arrays(size_mb * MB)))
            frames = [payload] if len(payload) <= chunk_size else chunk_frames(payload, chunk_size)
            raw_bytes = size_mb * MB
            runs = []
            for _ in range(repeats):
                parent.send(("raw", len(frames), timeout))
                sent = sender.send_raw(frames)
                if not parent.poll(timeout + 30):
                    raise TimeoutError(f"{broker_name}: no answer from the receiver for raw {size_mb} MB")
                got = parent.recv()
                if not got["ok"]:
                    runs.append({"error": f"{got['frames']} of {len(frames)} frames arrived"})
                    break
                runs.append({"seconds": got["done_at"] - sent["started_at"],
                             "mb_per_s": raw_bytes / (got["done_at"] - sent["started_at"]) / MB,
                             "last_frame_at": got["last_frame_at"] - sent["started_at"]})
            row = _summarize({"broker": broker_name, "protocol": used_protocol, "chunk_size": chunk_size,
                              "payload_mb": size_mb, "raw_bytes": raw_bytes, "mode": "raw"}, runs)
            rows.append(row)
            _print_row(row)
        parent.send(("stop",))
        receiver.join(timeout=10)
    except (TimeoutError, RuntimeError, EOFError, BrokenPipeError) as exc:
        rows.append({"broker": broker_name, "chunk_size": chunk_size, "error": f"{type(exc).__name__}: {exc}"})
        print(f"  {broker_name} chunk {chunk_size}: {exc}", flush=True)
    finally:
        if sender is not None:
            sender.close()
        if receiver.is_alive():
            receiver.terminate()
            receiver.join(timeout=10)
    return rows


def _summarize(base: dict, runs: list[dict]) -> dict:
    good = [r for r in runs if "error" not in r]
    if not good:
        return {**base, "error": runs[-1]["error"] if runs else "no run", "runs": runs}
    best = min(good, key=lambda r: r["seconds"])
    median_seconds = statistics.median(r["seconds"] for r in good)
    row = {**base, **{k: v for k, v in best.items()}, "repeats": len(good), "seconds": median_seconds,
           "mb_per_s": base["raw_bytes"] / median_seconds / MB,
           "best_mb_per_s": base["raw_bytes"] / best["seconds"] / MB}
    if "publish_seconds" in best:
        publish = statistics.median(r["publish_seconds"] for r in good)
        row.update(publish_seconds=publish, publish_mb_per_s=base["raw_bytes"] / publish / MB)
    if len(good) < len(runs):
        row["error"] = runs[-1]["error"]
    return row


def _chunk_label(chunk_size: int) -> str:
    if chunk_size == MAX_CHUNK_SIZE:
        return "64 MiB (unchunked)"
    return f"{chunk_size >> 20} MiB" if chunk_size >= 1 << 20 else f"{chunk_size >> 10} KiB"


def _print_row(row: dict) -> None:
    if "error" in row and "mb_per_s" not in row:
        print(f"  {row['broker']:>9} {_chunk_label(row['chunk_size']):>18} {row.get('payload_mb', '?'):>4} MB "
              f"{row.get('mode', '')}: {row['error']}", flush=True)
        return
    print(f"  {row['broker']:>9} {_chunk_label(row['chunk_size']):>18} {row['payload_mb']:>4} MB {row['mode']:>7}: "
          f"{row['seconds']:7.3f} s  {row['mb_per_s']:7.1f} MB/s"
          + (f"  (from first publish {row['publish_mb_per_s']:7.1f})" if "publish_mb_per_s" in row else ""),
          flush=True)


# -- report --------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["## Wire encoding (edge_sdk.wire), float32 arrays in a ResNet-like layout", "",
             "| payload MB | arrays | encode MB/s | decode MB/s | chunk_frames 1 MiB MB/s | reassemble 1 MiB MB/s "
             "| sha256 MB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in result["wire"]:
        lines.append(f"| {r['payload_mb']} | {r['arrays']} | {r['encode_mb_per_s']:.0f} | {r['decode_mb_per_s']:.0f} "
                     f"| {r['chunk_frames_1mib_mb_per_s']:.0f} | {r['reassemble_1mib_mb_per_s']:.0f} "
                     f"| {r['sha256_mb_per_s']:.0f} |")
    lines += ["", "## Transfers: Channel.send (encoding included) to the decoded envelope in another process", "",
              f"median of {result['settings']['repeats']} runs; MB/s of raw tensor bytes; timeline columns are seconds "
              "after the send() call, from the best run", "",
              "| broker | chunk | payload MB | frames | s | MB/s | MB/s from 1st publish | encode s | chunk s "
              "| publish calls s "
              "| first frame at | last frame at | reassembly s | decode s | done after last frame s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["transfers"]:
        if r.get("mode") != "channel":
            continue
        if "mb_per_s" not in r:
            lines.append(f"| {r['broker']} | {_chunk_label(r['chunk_size'])} | {r.get('payload_mb', '-')} | | "
                         f"failed: {r['error']} |||||||||||")
            continue
        reassembly = r["reassembly_store_seconds"] + r["reassembly_join_sha256_seconds"]
        lines.append(
            f"| {r['broker']} | {_chunk_label(r['chunk_size'])} | {r['payload_mb']} | {r['frames_sent']} "
            f"| {f(r['seconds'])} "
            f"| {r['mb_per_s']:.1f} | {r['publish_mb_per_s']:.1f} | {f(r['encode_seconds'])} | {f(r['chunk_seconds'])} "
            f"| {f(r['publish_calls_seconds'])} | {f(r['first_frame_at'])} | {f(r['last_frame_at'])} | {f(reassembly)} "
            f"| {f(r['decode_seconds'])} | {f(r['after_last_frame_seconds'])} |")
    raw = [r for r in result["transfers"] if r.get("mode") == "raw"]
    if raw:
        lines += ["", "## Raw frames: the same MQTT messages with no Channel on either side (paho + broker)", "",
                  "| broker | chunk | payload MB | s | MB/s |", "|---|---|---|---|---|"]
        for r in raw:
            if "mb_per_s" in r:
                lines.append(f"| {r['broker']} | {_chunk_label(r['chunk_size'])} | {r['payload_mb']} "
                             f"| {f(r['seconds'])} "
                             f"| {r['mb_per_s']:.1f} |")
            else:
                lines.append(f"| {r['broker']} | {_chunk_label(r['chunk_size'])} | {r['payload_mb']} "
                             f"| failed: {r['error']} | |")
    lines += ["", "## Wire overhead (ByteCounter bytes: payload + topic, chunk headers included, / raw tensor bytes)",
              "",
              "| payload MB | chunk | frames | ratio |", "|---|---|---|---|"]
    for r in result["overhead"]:
        lines.append(f"| {r['payload_mb']} | {_chunk_label(r['chunk_size'])} | {r['frames']} | {r['ratio']:.5f} |")
    t = result["targets"]
    mosquitto_met = t["mosquitto_50mb_met"]
    mosquitto_verdict = "met" if mosquitto_met else "missed" if mosquitto_met is False else "not measured"
    lines += ["", "## Targets", "",
              f"- wire overhead on payloads >= 1 MB: {result['wire_overhead_ratio']:.5f} (target <= 1.02): "
              f"{'met' if t['wire_overhead_met'] else 'missed'}",
              f"- 50 MB through Mosquitto (1 MiB chunks, default): {f(t['mosquitto_50mb_mb_per_s'], 1)} MB/s "
              "end to end, "
              f"{f(t['mosquitto_50mb_publish_mb_per_s'], 1)} MB/s from the first publish (target >= 100): "
              f"{mosquitto_verdict}",
              "", f"machine: {result['machine']['cpu_model']}, {result['machine']['cores']} cores, "
              "load average at start "
              f"{result['machine']['load_average_at_start']}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [r["payload_mb"] for r in result["wire"]]
    for key, label in (("encode", "encode"), ("decode", "decode"), ("chunk_frames_1mib", "chunk_frames 1 MiB"),
                       ("reassemble_1mib", "reassemble 1 MiB")):
        left.plot(sizes, [r[f"{key}_mb_per_s"] for r in result["wire"]], marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="payload (MB of float32)", ylabel="MB/s", title="edge_sdk.wire")
    left.legend()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in result["transfers"]:
        if r.get("mode") == "channel" and "mb_per_s" in r:
            name = f"{r['broker']}, {_chunk_label(r['chunk_size'])}"
            series.setdefault(name, []).append((r["payload_mb"], r["mb_per_s"]))
    for label, points in series.items():
        right.plot(*zip(*points, strict=True), marker="o", label=label)
    right.axhline(100, color="grey", linestyle="--", linewidth=1, label="target 100 MB/s")
    right.set(xscale="log", xlabel="payload (MB of float32)", ylabel="MB/s (send() to decoded envelope)",
              title="Channel to Channel through the broker")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 10 MB, one run each: a smoke test")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--broker", help="mqtt://host:port: measure this broker instead of Mosquitto and amqtt")
    parser.add_argument("--brokers", default="mosquitto,amqtt", help="which local brokers to start (default: both)")
    parser.add_argument("--repeats", type=int, help="runs per transfer (default 3, quick 1)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for one transfer")
    parser.add_argument("--sizes", help="transfer sizes in MB, e.g. 50 (default 1,10,50,100; quick 1,10)")
    parser.add_argument("--chunk-sizes", help="chunk sizes in bytes (default 1 MiB, 128 KiB and 64 MiB)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    repeats = args.repeats or (1 if args.quick else 3)
    wire_sizes = [1, 10] if args.quick else [1, 10, 100]
    sizes = [int(size) for size in args.sizes.split(",")] if args.sizes else [1, 10] if args.quick else [1, 10, 50, 100]
    raw_sizes = [10] if args.quick else [50]
    chunk_sizes = ([int(size) for size in args.chunk_sizes.split(",")] if args.chunk_sizes
                   else [DEFAULT_CHUNK_SIZE, 128 << 10, MAX_CHUNK_SIZE])
    brokers = [args.broker] if args.broker else args.brokers.split(",")
    result: dict = {"machine": machine_info(),
                    "settings": {"quick": args.quick, "repeats": repeats, "wire_sizes_mb": wire_sizes,
                                 "transfer_sizes_mb": sizes, "raw_sizes_mb": raw_sizes, "chunk_sizes": chunk_sizes,
                                 "brokers": brokers, "mb": MB}}
    result["wire"] = bench_wire(wire_sizes, repeats=3 if args.quick else 5)
    result["overhead"] = overhead_rows([s for s in sorted(set(wire_sizes + sizes)) if s >= 1], chunk_sizes)
    transfers: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="edgepfl-transport-") as workdir:
        for name in brokers:
            label = "external" if "://" in name else name
            try:
                with broker(name, Path(workdir)) as (url, protocol, _):
                    for chunk_size in chunk_sizes:
                        transfers += bench_transfers(label, url, protocol, chunk_size, sizes, repeats, args.timeout,
                                                     raw_sizes if chunk_size == DEFAULT_CHUNK_SIZE else [])
            except RuntimeError as exc:
                transfers.append({"broker": label, "error": str(exc)})
                print(f"{label}: {exc}", file=sys.stderr)
    result["transfers"] = transfers
    measured = [r["sent_bytes"] / r["raw_bytes"] for r in transfers
                if r.get("mode") == "channel" and "sent_bytes" in r and r["raw_bytes"] >= MB]
    result["wire_overhead_ratio"] = max([r["ratio"] for r in result["overhead"] if r["raw_bytes"] >= MB] + measured)
    result["wire_overhead_ratio_measured"] = max(measured) if measured else None
    target = next((r for r in transfers if r.get("broker") == "mosquitto" and r.get("mode") == "channel"
                   and r.get("payload_mb") == 50 and r.get("chunk_size") == DEFAULT_CHUNK_SIZE
                   and "mb_per_s" in r), None)
    result["targets"] = {
        "wire_overhead_max": 1.02,
        "wire_overhead_met": result["wire_overhead_ratio"] <= 1.02,
        "mosquitto_50mb_mb_per_s": target["mb_per_s"] if target else None,
        "mosquitto_50mb_publish_mb_per_s": target["publish_mb_per_s"] if target else None,
        "mosquitto_50mb_min_mb_per_s": 100.0,
        "mosquitto_50mb_met": (target["mb_per_s"] >= 100.0) if target else None,
    }
    (out / "transport.json").write_text(json.dumps(result, indent=2))
    (out / "transport.md").write_text(markdown(result))
    plot(result, out / "transport.png")
    print(markdown(result))


if __name__ == "__main__":
    main()

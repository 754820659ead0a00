"""A large model through the channel's chunked path, stage by stage, on one core.

    taskset -c 0 env OMP_NUM_THREADS=1 python -m benchmarks.receive_path --out benchmarks/results
    python -m benchmarks.receive_path --quick        # 10 MB, 3 repeats: a smoke test

Send side (the coordinator's broadcast of the same arrays): `send_encode` (`wire.encode_pieces`)
and `send_frames` (`chunks.iter_frames`: sha256 of the pieces, then every 1 MiB frame joined; the
publish calls and the broker are `transport.py`'s). Receive side: a TRAIN_RES (the reference plus
small noise, float32, `transport.model_like_arrays`'s ResNet-like layout) in 1 MiB chunk frames
as they arrive from MQTT. Stages, each timed on its own, then the whole path in one go (`path`):
`unpack` (every frame's msgpack map and chunk checks), `reassemble` (`Reassembler.add` of every
frame: sha256 and join), `last_frame` (its `add` of the last frame alone: what is left to do once
the last frame is in), `decode` (`wire.decode`), `validate` (`checked_update`, fp32 codec, with a
norm bound: names, dtypes, shapes, finite values, the norm of the change), `fold_first`
(`WeightedMean.add` into a fresh mean: its accumulator is allocated too) and `fold` (into a mean
that holds one update already); `sha256` alone is the reference. GB/s = bytes of the encoded
update / seconds: the median and the best of `--repeats` runs (on shared cores the best is what
one core does). glibc's mmap threshold is fixed as the coordinator fixes it (`coordinator.memory`).
Writes receive_path.json and .md to --out when given.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.aggregation.averaging import WeightedMean
from coordinator.aggregation.validation import UpdateLimits, checked_update
from coordinator.memory import return_freed_buffers
from edge_sdk import wire
from edge_sdk.chunks import DEFAULT_CHUNK_SIZE, Reassembler, chunk_frames, chunk_from_dict, iter_frames
from edge_sdk.protocol import COORDINATOR, Envelope, Kind

from ._brokers import machine_info
from .aggregation import EXAMPLES, GROUP, NORM_BOUND, UpdateSpec
from .transport import model_like_arrays

STAGES = ("send_encode", "send_frames", "unpack", "reassemble", "last_frame", "sha256", "decode", "validate",
          "fold_first", "fold", "path")


def update_of(reference: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {k: v + np.float32(0.01) * rng.standard_normal(v.shape, dtype=np.float32) for k, v in reference.items()}


def measure(nbytes: int, repeats: int) -> dict[str, Any]:
    reference = model_like_arrays(nbytes)
    envelope = Envelope(Kind.TRAIN_RES, "dev0", run_id="bench", round=1, groups={GROUP: update_of(reference)},
                        metrics={"num_examples": EXAMPLES})
    payload = wire.encode(envelope)
    del envelope
    sent, algorithm = {GROUP: reference}, UpdateSpec.standing_in(reference)
    limits = UpdateLimits(10**9, NORM_BOUND)

    def frames() -> list[bytes]:
        return [bytes(frame) for frame in chunk_frames(payload, DEFAULT_CHUNK_SIZE)]  # as paho hands them over

    def unpack(frame_list: list[bytes]) -> list[Any]:
        return [chunk_from_dict(wire.unpack(frame)) for frame in frame_list]

    def reassembler(chunks: list[Any]) -> Reassembler:
        """One that holds every chunk but the last."""
        assembler = Reassembler(max_blob_bytes=1 << 31, max_pending_bytes=1 << 31)
        for chunk in chunks[:-1]:
            assert assembler.add("up/dev0", chunk) is None
        return assembler

    def reassemble(chunks: list[Any]) -> bytes | memoryview:
        blob = reassembler(chunks).add("up/dev0", chunks[-1])
        assert blob is not None
        return blob

    def validate(decoded: Envelope) -> tuple[dict, float]:
        return checked_update(algorithm, 1, decoded, sent, EXAMPLES, limits, "fp32")

    def warm_mean() -> WeightedMean:
        mean = WeightedMean(reference)
        mean.add(reference, 1.0)
        return mean

    def path(frame_list: list[bytes]) -> None:
        blob = reassemble(unpack(frame_list))
        groups, weight = validate(wire.decode(blob))
        WeightedMean(reference).add(groups[GROUP], weight)

    times: dict[str, list[float]] = {stage: [] for stage in STAGES}

    def clock(stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        gc.collect()
        started = time.perf_counter()
        out = fn(*args)
        times[stage].append(time.perf_counter() - started)
        return out

    def send_frames(pieces: list[bytes | memoryview]) -> int:
        return sum(len(frame) for frame in iter_frames(pieces, DEFAULT_CHUNK_SIZE))

    for _ in range(repeats):
        envelope = Envelope(Kind.TRAIN, COORDINATOR, run_id="bench", round=1, groups={GROUP: reference})
        clock("send_frames", send_frames, clock("send_encode", wire.encode_pieces, envelope))
        chunks = clock("unpack", unpack, frames())
        blob = clock("reassemble", reassemble, chunks)
        clock("last_frame", reassembler(chunks).add, "up/dev0", chunks[-1])
        clock("sha256", lambda b: hashlib.sha256(b).digest(), blob)
        decoded = clock("decode", wire.decode, blob)
        groups, weight = clock("validate", validate, decoded)
        clock("fold_first", WeightedMean(reference).add, groups[GROUP], weight)
        mean = warm_mean()
        clock("fold", mean.add, groups[GROUP], weight)
        del chunks, blob, decoded, groups, mean
        clock("path", path, frames())
    size = len(payload)
    stages = {stage: {"seconds": statistics.median(t), "gb_per_s": size / statistics.median(t) / 1e9,
                      "best_gb_per_s": size / min(t) / 1e9, "runs": t} for stage, t in times.items()}
    return {"payload_bytes": size, "arrays": len(reference), "frames": len(frames()), "stages": stages}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# receive_path: {result['payload_bytes'] / 1e6:.1f} MB update, {result['frames']} frames of 1 MiB, "
             f"{result['arrays']} arrays", "",
             "{cpu_model}, {cores} cores, {ram_gib} GiB; numpy {numpy}; code {code}; "
             "load average {load_average_at_start} at start".format(**result["machine"]), "",
             "| stage | seconds (median) | GB/s (median) | GB/s (best run) |", "|---|---|---|---|"]
    for stage, row in result["stages"].items():
        lines.append(f"| {stage} | {row['seconds']:.4f} | {row['gb_per_s']:.2f} | {row['best_gb_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 MB, 3 repeats")
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="folder for receive_path.json and .md")
    args = parser.parse_args()
    return_freed_buffers()
    mb, repeats = (10.0, 3) if args.quick else (args.mb, args.repeats)
    result = measure(int(mb * 1e6) // 4 * 4, repeats)
    result["machine"] = machine_info()
    result["settings"] = {"mb": mb, "repeats": repeats, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                          "cpus": sorted(os.sched_getaffinity(0))}
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "receive_path.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "receive_path.md").write_text(text)


if __name__ == "__main__":
    main()

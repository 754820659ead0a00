"""Aggregation throughput: MB of float32 updates per second received, validated and folded.

Full run (3-6 minutes on 2 cores):

    python -m benchmarks.aggregation --out benchmarks/results

Quick (a smoke test, seconds): `python -m benchmarks.aggregation --quick --out DIR`. The same
script measures another checkout's library (e.g. main's, "before"): run it with
`PYTHONPATH=/path/to/checkout` and `--name aggregation-before`; it calls only public functions
that both have, and records which library it measured (`library`: its folder and commit).

MB = 10^6 bytes of float32 update data. Models: 0.1 MB (4 arrays), cnn32 as scale.py uses it
(924,804 shared parameters, 3.7 MB, 10 arrays) and 25 MB (ResNet-18's first layers, 44 arrays).
Each update is the reference (the "broadcast" state) plus small noise, encoded as a device
encodes a TRAIN_RES; the process cycles through enough distinct updates (64 MB or more for the
larger models) that they come from memory, not the CPU cache, as received ones would. glibc's
mmap threshold is fixed as the coordinator fixes it (`coordinator.memory`), so every buffer of
128 KiB or more is a fresh mapping, as there.

1. `stages`, per model in a process of its own pinned to one CPU (`--cpu`): MB/s of each step
   of the coordinator's per-update path, each timed alone, update by update, over `--repeats`
   passes through all the updates: from the fastest update (`best`: on cores shared with other
   jobs, the update that ran without being preempted; what one core does) and the median one,
   and per CPU-second of a whole pass (the process, all its threads). Steps: `sha256` of the
   encoded update (the reference figure), `reassembly` (its 1 MiB chunk frames unpacked,
   checked and reassembled: join + sha256, `chunks.Reassembler`), `wire_decode`
   (`wire.decode`), `codec_decode_fp16` / `codec_decode_int8` (`codecs.decode` of an fp16 /
   int8 upload back to float32, MB of float32 out), `check_arrays` (names, dtypes, shapes,
   finite), `check_update` (check_arrays and the example count, no norm bound) and
   `check_update_norm` (with a norm bound: the norm's cost is the difference), `fold`
   (`WeightedMean.add`, float32 mode) and `fold_float64` (`--aggregation-dtype float64`), then
   the whole path: `validate_fold` (`checked_update` with a norm bound, then
   `WeightedMean.add`, on decoded envelopes), `decode_validate_fold` (from the message bytes:
   uploads up to 64 MiB travel as one MQTT message) and `reassemble_decode_validate_fold` (from
   1 MiB chunk frames, as over a broker whose maximum packet size forces chunking, sha256
   included); last `delta_norm` (the float64 norm alone, as `check_update` computed it for every
   update before and now only near or over the bound).
2. `shards`: K = 1, 2 and 4 processes (unpinned), each decoding, validating and folding its
   share of the same N updates, as `edgepfl aggregator --shard k/K` does; the aggregate MB/s
   is all the bytes over the time from the first process's start to the last one's end (the
   processes start together at a barrier), and the scaling factor is K shards' MB/s over one's;
   with the CPU seconds the shards used together.

Writes <name>.json and <name>.md to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, cast
from collections.abc import Callable, Iterable

import numpy as np

import edge_sdk
from coordinator.aggregation.averaging import WeightedMean
from coordinator.aggregation.validation import UpdateLimits, check_update, checked_update, delta_norm
from coordinator.algorithms.base import ServerAlgorithm
from coordinator.memory import return_freed_buffers
from edge_sdk import codecs, wire
from edge_sdk.chunks import DEFAULT_CHUNK_SIZE, Reassembler, chunk_frames, chunk_from_dict
from edge_sdk.params import check_arrays, spec_of
from edge_sdk.protocol import Envelope, Kind

from ._machine import machine_info

MB = 1_000_000
GROUP = "shared"
EXAMPLES = 100
NORM_BOUND = 1e6
"""Far above the updates' norms (about 0.01 * sqrt(parameters)): every update passes, and pays for the norm."""

CNN32 = [(32, 3, 5, 5), (32,), (32,), (64, 32, 5, 5), (64,), (64,), (512, 1600), (512,), (100, 512), (100,)]
SMALL = [(16, 3, 3, 3), (16,), (96, 256), (96,)]
_RESNET: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
for _c_in, _c_out in ((64, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256), (256, 512), (512, 512)):
    _RESNET += [(_c_out, _c_in, 3, 3), (_c_out,), (_c_out,), (_c_out, _c_out, 3, 3), (_c_out,), (_c_out,)]
MODELS: dict[str, list[tuple[int, ...]]] = {"0.1MB": SMALL, "cnn32-3.7MB": CNN32, "25MB": _RESNET}


def layout(name: str) -> list[tuple[int, ...]]:
    """The model's shapes; the 25 MB one is ResNet-18's first layers, cut to 6.25M parameters."""
    if name != "25MB":
        return MODELS[name]
    shapes, left = [], 25 * MB // 4
    for shape in _RESNET:
        size = math.prod(shape)
        shapes.append(shape if size <= left else (left,))
        left -= min(size, left)
        if not left:
            return shapes
    raise AssertionError("the layout holds fewer than 25 MB")


def reference_state(shapes: list[tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer{i:02d}": rng.standard_normal(shape, dtype=np.float32) for i, shape in enumerate(shapes)}


def update_of(reference: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return {k: v + np.float32(0.01) * rng.standard_normal(v.shape, dtype=np.float32) for k, v in reference.items()}


def envelope_of(groups: dict[str, np.ndarray], index: int) -> Envelope:
    return Envelope(Kind.TRAIN_RES, f"dev{index:04d}", run_id="bench", round=1, groups={GROUP: groups},
                    metrics={"num_examples": EXAMPLES})


class UpdateSpec:
    """The one thing `checked_update` asks of the server algorithm: what an update must look like."""

    def __init__(self, reference: dict[str, np.ndarray]) -> None:
        self.spec = {GROUP: spec_of(reference)}

    @classmethod
    def standing_in(cls, reference: dict[str, np.ndarray]) -> ServerAlgorithm:
        """One, typed as the server algorithm it stands in for (it has all that checked_update uses)."""
        return cast(ServerAlgorithm, cls(reference))

    def update_spec(self, round_: int) -> dict:
        return self.spec

    def validate_update(self, client_id: str, groups: dict, metrics: dict, registered_examples: int) -> None:
        """No algorithm-specific checks (FedAvg has none)."""


def payloads(reference: dict[str, np.ndarray], seeds: Iterable[int]) -> list[bytes]:
    return [wire.encode(envelope_of(update_of(reference, seed), seed)) for seed in seeds]


def fold_all(reference: dict[str, np.ndarray], payload_list: list[bytes], dtype: str = "float32") -> WeightedMean:
    """The coordinator's per-update path from the message bytes: decode, validate, fold."""
    algorithm, sent = UpdateSpec.standing_in(reference), {GROUP: reference}
    limits = UpdateLimits(max_examples=10**9, max_update_norm=NORM_BOUND)
    mean = WeightedMean(reference, dtype)
    for payload in payload_list:
        groups, weight = checked_update(algorithm, 1, wire.decode(payload), sent, EXAMPLES, limits, "fp32")
        mean.add(groups[GROUP], weight)
    return mean


Step = Callable[[int, Any], Any]
"""One stage's work on update i, given what `fresh` made for this pass (an accumulator, a reassembler)."""


def timed(step: Step, fresh: Callable[[], Any], count: int, repeats: int) -> tuple[list[float], list[float]]:
    """Wall-clock seconds of every update's step over `repeats` passes, and CPU seconds of each
    pass (this process, all its threads)."""
    wall, cpu = [], []
    for _ in range(repeats):
        state, cpu_started = fresh(), time.process_time()
        for index in range(count):
            started = time.perf_counter()
            step(index, state)
            wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    return wall, cpu


def stage_rows(model: str, quick: bool, repeats: int) -> list[dict[str, Any]]:
    shapes = layout(model)
    reference = reference_state(shapes)
    model_bytes = sum(a.nbytes for a in reference.values())
    count = 2 if quick else max(4, math.ceil(64 * MB / model_bytes))
    updates = [update_of(reference, seed) for seed in range(count)]
    encoded = [wire.encode(envelope_of(u, i)) for i, u in enumerate(updates)]
    frames = [chunk_frames(p, DEFAULT_CHUNK_SIZE) for p in encoded]
    envelopes = [wire.decode(p) for p in encoded]
    sent, spec, algorithm = {GROUP: reference}, {GROUP: spec_of(reference)}, UpdateSpec.standing_in(reference)
    bounded, unbounded = UpdateLimits(10**9, NORM_BOUND), UpdateLimits(10**9, 0.0)
    received = {codec: [{GROUP: codecs.encode(codec, {GROUP: u}, sent)[GROUP]} for u in updates]
                for codec in ("fp16", "int8")}

    def reassembler() -> Reassembler:
        return Reassembler(max_blob_bytes=1 << 31, max_pending_bytes=1 << 31)

    def reassemble(index: int, assembler: Reassembler) -> bytes | memoryview:
        for frame in frames[index]:
            blob = assembler.add(f"up/{index}", chunk_from_dict(wire.unpack(frame)))
        assert blob is not None, "the last frame completes the blob"
        return blob

    def fold(index: int, mean: WeightedMean, envelope: Envelope | None = None) -> None:
        groups, weight = checked_update(algorithm, 1, envelope or envelopes[index], sent, EXAMPLES, bounded, "fp32")
        mean.add(groups[GROUP], weight)

    def mean(dtype: str = "float32") -> Callable[[], WeightedMean]:
        return lambda: WeightedMean(reference, dtype)

    def none() -> None:
        return None

    stages: dict[str, tuple[Step, Callable[[], Any]]] = {
        "sha256": (lambda i, _: hashlib.sha256(encoded[i]).digest(), none),
        "reassembly": (reassemble, reassembler),
        "wire_decode": (lambda i, _: wire.decode(encoded[i]), none),
        "codec_decode_fp16": (lambda i, _: codecs.decode("fp16", received["fp16"][i], sent, spec), none),
        "codec_decode_int8": (lambda i, _: codecs.decode("int8", received["int8"][i], sent, spec), none),
        "check_arrays": (lambda i, _: check_arrays(GROUP, envelopes[i].groups[GROUP], spec[GROUP]), none),
        "check_update": (lambda i, _: check_update(envelopes[i], spec, sent, EXAMPLES, unbounded), none),
        "check_update_norm": (lambda i, _: check_update(envelopes[i], spec, sent, EXAMPLES, bounded), none),
        "fold": (lambda i, m: m.add(envelopes[i].groups[GROUP], float(EXAMPLES)), mean()),
        "fold_float64": (lambda i, m: m.add(envelopes[i].groups[GROUP], float(EXAMPLES)), mean("float64")),
        "validate_fold": (fold, mean()),
        "decode_validate_fold": (lambda i, m: fold(i, m, wire.decode(encoded[i])), mean()),
        "reassemble_decode_validate_fold": (
            lambda i, state: fold(i, state[1], wire.decode(reassemble(i, state[0]))), lambda: (reassembler(),
                                                                                             mean()())),
        "delta_norm": (lambda i, _: delta_norm(envelopes[i].groups, sent), none),  # last: see `profile`
    }
    rows = []
    megabytes = model_bytes / MB
    for stage, (step, fresh) in stages.items():
        wall, cpu = timed(step, fresh, count, repeats)
        rows.append({"model": model, "model_mb": round(megabytes, 3), "arrays": len(shapes), "updates": count,
                     "stage": stage, "mb_per_s_best": round(megabytes / min(wall), 1),
                     "mb_per_s_median": round(megabytes / statistics.median(wall), 1),
                     "mb_per_cpu_s_best": round(count * megabytes / max(min(cpu), 1e-9), 1),
                     "ms_per_update_best": round(min(wall) * 1e3, 4),
                     "ms_per_update_median": round(statistics.median(wall) * 1e3, 4)})
    return rows


def profile(model: str, quick: bool, repeats: int, cpu: int) -> list[dict[str, Any]]:
    """`stage_rows` in a process of its own, pinned to `cpu` (-1: not pinned): BLAS threads that
    one model's stages started (their float64 dots) spin on that CPU for a while after each call
    and would slow the next model's stages."""
    return_freed_buffers()
    if cpu >= 0:
        os.sched_setaffinity(0, {cpu})
    return stage_rows(model, quick, repeats)


def _shard_main(model: str, seeds: list[int], passes: int, barrier, results) -> None:
    return_freed_buffers()
    reference = reference_state(layout(model))
    share = payloads(reference, seeds)
    fold_all(reference, share[:1])  # warm up: imports, first allocations
    barrier.wait()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(passes):
        fold_all(reference, share)
    results.put((started, time.perf_counter(), passes * len(share) * sum(a.nbytes for a in reference.values()),
                 time.process_time() - cpu_started))


def shard_row(model: str, shards: int, updates: int, passes: int) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(shards), context.Queue()
    workers = [context.Process(target=_shard_main, args=(model, list(range(k, updates, shards)), passes, barrier,
                                                          results)) for k in range(shards)]
    for worker in workers:
        worker.start()
    spans = [results.get(timeout=1800) for _ in workers]
    for worker in workers:
        worker.join()
    seconds = max(end for _, end, _, _ in spans) - min(start for start, _, _, _ in spans)
    total, cpu = sum(size for _, _, size, _ in spans), sum(cpu for *_, cpu in spans)
    return {"model": model, "shards": shards, "updates": updates * passes, "seconds": round(seconds, 3),
            "mb_per_s": round(total / MB / seconds, 1), "cpu_seconds": round(cpu, 3),
            "mb_per_cpu_s": round(total / MB / cpu, 1)}


def library_info() -> dict[str, Any]:
    """Which edgepfl library was measured (PYTHONPATH may point at another checkout)."""
    folder = Path(edge_sdk.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=folder).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, False
    return {"folder": str(folder), "commit": commit and commit + ("+changes" if dirty else "")}


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# {data['name']}: aggregation throughput", "",
             f"{data['machine']['cpu_model']}, {data['machine']['cores']} cores; library {data['library']['commit']} "
             f"({data['library']['folder']}); load average {data['machine']['load_average_at_start']} at start, "
             f"{data['load_average_at_end']} at end", "",
             "## Stages, one core (MB of float32 update data per second: fastest update / median update; "
             "per CPU-second of the best pass)", "",
             "| stage | " + " | ".join(data["settings"]["models"]) + " |",
             "|---|" + "---|" * len(data["settings"]["models"])]
    by = {(row["stage"], row["model"]): row for row in data["stages"]}
    for stage in dict.fromkeys(row["stage"] for row in data["stages"]):
        cells = [f"{by[stage, m]['mb_per_s_best']:,.0f} / {by[stage, m]['mb_per_s_median']:,.0f}; "
                 f"{by[stage, m]['mb_per_cpu_s_best']:,.0f}" for m in data["settings"]["models"]]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines += ["", "## Shards (processes, decode + validate + fold)", "",
              "| model | shards | updates | seconds | MB/s | scaling vs 1 shard | CPU seconds | MB per CPU-second |",
              "|---|---|---|---|---|---|---|---|"]
    for row in data["shards"]:
        lines.append(f"| {row['model']} | {row['shards']} | {row['updates']} | {row['seconds']} | "
                     f"{row['mb_per_s']:,.0f} | {row['scaling']:.2f}x | {row['cpu_seconds']} | "
                     f"{row['mb_per_cpu_s']:,.0f} |")
    targets = data["targets"]
    lines += ["", f"One shard's validate+fold of cnn32 updates (decoded, one core): "
                  f"{targets['validate_fold_mb_per_s']:,.0f} MB/s wall-clock, "
                  f"{targets['validate_fold_mb_per_cpu_s']:,.0f} MB per CPU-second (target >= 1,500: "
                  f"{'met' if targets['validate_fold_met'] else 'not met'}); "
                  f"2 shards / 1: {targets['scaling_2']:.2f}x (target >= 1.7: "
                  f"{'met' if targets['scaling_met'] else 'not met'}).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny counts, two models")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--name", default="aggregation", help="file name of the results (e.g. aggregation-before)")
    parser.add_argument("--repeats", type=int, help="timings per stage (default 7, quick 2)")
    parser.add_argument("--cpu", type=int, default=0, help="the CPU the stage profile is pinned to (-1: not pinned)")
    parser.add_argument("--shard-updates", type=int, help="updates per shard measurement (default 64, quick 4)")
    parser.add_argument("--passes", type=int, help="times each shard folds its share (default 4, quick 1)")
    args = parser.parse_args()
    models = ["0.1MB", "cnn32-3.7MB"] if args.quick else list(MODELS)
    repeats = args.repeats or (2 if args.quick else 7)
    shard_updates, passes = args.shard_updates or (4 if args.quick else 64), args.passes or (1 if args.quick else 4)
    machine = machine_info(("numpy", "msgpack"))
    stages = []
    for model in models:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            stages += pool.submit(profile, model, args.quick, repeats, args.cpu).result()
    shard_model = "cnn32-3.7MB"
    shards = [shard_row(shard_model, k, shard_updates, passes) for k in (1, 2, 4)]
    for row in shards:
        row["scaling"] = round(row["mb_per_s"] / shards[0]["mb_per_s"], 2)
    validate_fold = next(r for r in stages if r["stage"] == "validate_fold" and r["model"] == shard_model)
    data = {
        "name": args.name,
        "machine": machine,
        "library": library_info(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "settings": {"models": models, "repeats": repeats, "pinned_cpu": args.cpu, "norm_bound": NORM_BOUND,
                     "chunk_size": DEFAULT_CHUNK_SIZE, "shard_model": shard_model, "shard_updates": shard_updates,
                     "passes": passes},
        "stages": stages,
        "shards": shards,
        "targets": {"validate_fold_mb_per_s": validate_fold["mb_per_s_best"],
                    "validate_fold_mb_per_cpu_s": validate_fold["mb_per_cpu_s_best"],
                    "validate_fold_met": validate_fold["mb_per_cpu_s_best"] >= 1500,
                    "scaling_2": shards[1]["scaling"], "scaling_met": shards[1]["scaling"] >= 1.7},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()

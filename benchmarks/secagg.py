"""Secure aggregation's cost: the same rounds with and without `--secure-aggregation`.

    python -m benchmarks.secagg --out benchmarks/results

Quick (a smoke test, well under a minute): `python -m benchmarks.secagg --quick --out DIR`
(digits, 4 devices, 1 round; in-process rounds of 10 devices on 1,000-element vectors).

Two parts:

- **Over the broker** (`edgepfl simulate`'s path, `coordinator.hosting.simulate.run_simulation`, a Mosquitto
  started here, or `--broker`): per model and device count, a plain run and a secure run with the
  same devices, data and seed (FedAvg, 1 local epoch, `--rounds` rounds, float64 sums, every
  selected device awaited). Per round: bytes up and down (the coordinator's counters, evaluation
  included, equal in both), the round's seconds, the evaluation's seconds (`RoundEvaluated`) and
  the rest, training plus the protocol (`RoundStarted` to the end of the aggregation). Models:
  cnn28 and cnn32 on the 1,797 digits of scikit-learn drawn at 28x28 (grey) and at 32x32 in a
  random tint (RGB, as user_models.py draws them): offline, and the training work per round is
  the same at every device count (the same images split among more devices). The secure
  global model is compared with the plain one (max abs difference per coordinate) against the
  quantization's bound, the rounding error of the fixed point (`FixedPoint.max_error_per_summand`
  x devices) divided by the round's total weight (the mean divides the sum by it). The bound is
  that of one aggregation from the same model: after more rounds, local training from two
  slightly different models amplifies the difference, so the comparison is exact with 1 round.
- **In process** (`edge_sdk.secagg`'s client and server state machines, no broker, no training):
  rounds of `--inprocess-devices` devices on vectors of the models' lengths, in which some
  devices stop after key sharing (they never send their masked vector), with the degree and
  threshold of the settings. Per round: whether the unmasked sum equals the survivors' sum of
  the quantized vectors exactly (mod 2^32), the server's unmasking seconds (rebuilding the
  secrets from the shares and removing every mask) and each device's seconds per stage.

Writes secagg.json and secagg.md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._brokers import broker, machine_info
from .flags import add_output_flags, add_run_flags
from .runs import bench_config, setup_logging, log

MODELS = ("cnn28", "cnn32")
DEVICE_COUNTS = (10, 50, 200)
DROPOUTS = (0, 1, 5, 10, 15, 20)
"""Devices of an in-process round that stop after sharing keys (of 50: 10% is 5, 30% is 15)."""
TARGETS = {"bytes_up_ratio": 1.3, "round_seconds_ratio": 2.0, "at_devices": 200}
QUICK_LENGTH = 1000


# -- data ----------------------------------------------------------------------------------------
def digits_at(size: int, colour: bool, path: Path, seed: int = 0) -> Path:
    """The 1,797 digits drawn at size x size (each pixel a block of size // 8, centred), in a random
    tint when `colour`: an .npz of uint8 x [N, size, size] (grey) or [N, size, size, 3], and y."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    block = size // 8
    margin = (size - 8 * block) // 2
    images = np.zeros((len(digits.images), size, size))
    images[:, margin:margin + 8 * block, margin:margin + 8 * block] = np.kron(digits.images / 16.0,
                                                                              np.ones((1, block, block)))
    if colour:
        tint = np.random.default_rng(seed).uniform(0.3, 1.0, size=(len(images), 1, 1, 3))
        images = images[..., None] * tint
    np.savez(path, x=np.round(images * 255).astype(np.uint8), y=digits.target)
    return path


# -- over the broker -------------------------------------------------------------------------------
class StageMarks(logging.Handler):
    """When each stage of a secure round closed, from the debug line `SecAggServer` logs as it
    moves on ("secagg round R: <stage> stage closed by <action>"): round -> stage -> monotonic time."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.closed: dict[int, dict[str, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        arguments = record.args if isinstance(record.args, tuple) else ()
        if "stage closed by" in str(record.msg) and len(arguments) == 3 and isinstance(arguments[0], int):
            self.closed.setdefault(arguments[0], {}).setdefault(str(arguments[1]), time.monotonic())


@contextlib.contextmanager
def stage_marks() -> Iterator[StageMarks]:
    """The secure rounds' stage closings while the block runs (the coordinator runs in this process)."""
    logger = logging.getLogger("edge_sdk.secagg.server")
    handler, level, propagate = StageMarks(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def stage_seconds(started: float, closed: dict[str, float], aggregated: float | None) -> dict[str, float] | None:
    """A secure round's seconds per stage: advertise (keys), share (ciphertexts), train (TRAIN to the
    survivor set: training, masking, the uploads) and unmask (the survivors' signatures on the
    survivor set, their shares, the server's unmasking, the fold)."""
    marks = [closed.get("advertising"), closed.get("sharing"), closed.get("masking"), aggregated]
    points = [started, *(mark for mark in marks if mark is not None)]
    if len(points) < 5:
        return None
    return {name: points[i + 1] - points[i] for i, name in enumerate(("advertise", "share", "train", "unmask"))}


def run_one(config) -> dict[str, Any]:
    """One run: its rounds (bytes, seconds, evaluation seconds, the stages' seconds and the secagg
    entry under secure aggregation) and its global model."""
    from coordinator.events import RoundAggregated, RoundEvaluated, RoundStarted
    from coordinator.hosting.simulate import run_simulation
    from coordinator.run import checkpoint
    from coordinator.run.folder import RunFolder

    marks: dict[int, dict[str, float]] = {}

    def on_event(event) -> None:
        if isinstance(event, RoundStarted):
            marks[event.round] = {"started": time.monotonic()}
        elif isinstance(event, RoundAggregated):
            marks[event.round]["aggregated"] = time.monotonic()
        elif isinstance(event, RoundEvaluated):
            marks[event.round]["evaluation_seconds"] = event.seconds

    started = time.monotonic()
    with stage_marks() as stages:
        report = run_simulation(config, on_event=on_event)
    wall = time.monotonic() - started
    rounds = []
    for record in report["rounds"]:
        mark = marks.get(record["round"], {})
        rounds.append({"round": record["round"], "participants": record["participants"],
                       "bytes_up": record["bytes_up"], "bytes_down": record["bytes_down"],
                       "seconds": record["seconds"], "evaluation_seconds": mark.get("evaluation_seconds"),
                       "train_seconds": (mark["aggregated"] - mark["started"]) if "aggregated" in mark else None,
                       "stage_seconds": (stage_seconds(mark["started"], stages.closed.get(record["round"], {}),
                                                       mark.get("aggregated"))
                                         if record.get("secagg") and "started" in mark else None),
                       "secagg": record.get("secagg")})
    saved = checkpoint.load(RunFolder(config.run.out).checkpoint)
    if saved is None:
        raise RuntimeError(f"{config.run.out}: the run left no checkpoint")
    return {"rounds": rounds, "wall_seconds": wall, "state": saved.state,
            "final_accuracy": report["final"]["personalized_accuracy"]["mean"]}


def floating_length(state: dict) -> int:
    """The floating values of a global state: the secure vector's length less its weight element."""
    return sum(int(np.asarray(a).size) for arrays in state.values() for a in arrays.values()
               if np.asarray(a).dtype.kind == "f")


def quantization(plain_state: dict, secure_state: dict, devices: int, clip: float, total_weight: float) -> dict:
    """The max abs difference between the two global models and the fixed point's bound on it.

    The bound on the model is the rounding error of the sum (per summand x devices) over the
    total weight; the models are kept in float32, so each coordinate may differ by one more unit
    in the last place of float32 (`within_bound` allows that)."""
    from edge_sdk.secagg.fixedpoint import FixedPoint

    per_summand = FixedPoint(max(clip, 1.0), devices).max_error_per_summand
    model_bound = per_summand * devices / total_weight
    largest, outside, coordinates = 0.0, 0, 0
    for group, arrays in plain_state.items():
        for key, value in arrays.items():
            plain = np.asarray(value)
            if plain.dtype.kind != "f" or not plain.size:
                continue
            difference = np.abs(np.asarray(secure_state[group][key], dtype=np.float64) - plain.astype(np.float64))
            allowed = model_bound + np.spacing(np.abs(plain).astype(np.float32)).astype(np.float64)
            largest = max(largest, float(difference.max()))
            outside += int(np.count_nonzero(difference > allowed))
            coordinates += plain.size
    return {"max_error_per_summand": per_summand, "sum_bound": per_summand * devices, "total_weight": total_weight,
            "model_bound": model_bound, "max_abs_difference": largest, "coordinates": coordinates,
            "outside_bound": outside, "within_bound": outside == 0}


def compare_pair(model: str, devices: int, plain: dict, secure: dict, clip: float) -> dict:
    """The row of one model and device count: bytes per round over all rounds, seconds per round
    over the rounds after the first (the first also warms the worker processes up) when there
    are more, and the secure / plain ratios."""
    def per_round(run: dict, key: str, timed: bool) -> float:
        rounds = run["rounds"][1:] if timed and len(run["rounds"]) > 1 else run["rounds"]
        return float(sum(r[key] or 0 for r in rounds)) / len(rounds)

    row: dict[str, Any] = {"model": model, "devices": devices, "rounds": len(plain["rounds"]),
                           "timed_rounds": max(1, len(plain["rounds"]) - 1),
                           "parameters": floating_length(plain["state"])}
    for key in ("bytes_up", "bytes_down", "seconds", "evaluation_seconds", "train_seconds"):
        timed = "seconds" in key
        row[f"plain_{key}"], row[f"secure_{key}"] = per_round(plain, key, timed), per_round(secure, key, timed)
    row["bytes_up_ratio"] = row["secure_bytes_up"] / row["plain_bytes_up"]
    row["bytes_down_ratio"] = row["secure_bytes_down"] / row["plain_bytes_down"]
    row["seconds_ratio"] = row["secure_seconds"] / row["plain_seconds"]
    row["train_seconds_ratio"] = (row["secure_train_seconds"] / row["plain_train_seconds"]
                                  if row["plain_train_seconds"] else None)
    row["secagg"] = [r["secagg"] for r in secure["rounds"]]
    row["plain_rounds"], row["secure_rounds"] = plain["rounds"], secure["rounds"]
    stages = [r["stage_seconds"] for r in secure["rounds"]][-row["timed_rounds"]:]
    row["secure_stage_seconds"] = ({name: sum(s[name] for s in stages) / len(stages) for name in stages[0]}
                                   if stages and all(stages) else None)
    row["unmasked_all"] = all(r["secagg"] and r["secagg"]["unmasked"] == devices and not r["secagg"]["failed"]
                              for r in secure["rounds"])
    row["quantization"] = quantization(plain["state"], secure["state"], devices, clip, secure.get("total_weight", 1.0))
    return row


def broker_part(args, workdir: Path, on_row) -> list[dict]:
    """The plain and the secure run of every model and device count; `on_row` sees each row as it comes."""
    counts = [4] if args.quick else args.devices
    models = ["quick"] if args.quick else args.models
    rows = []
    sources: dict[str, dict[str, str]] = {"quick": {"dataset": "digits"}}
    if "cnn28" in models:
        sources["cnn28"] = {"data": str(digits_at(28, False, workdir / "digits28.npz"))}
    if "cnn32" in models:
        sources["cnn32"] = {"data": str(digits_at(32, True, workdir / "digits32.npz"))}
    with broker(args.broker or "mosquitto", workdir) as (url, protocol, _):
        for model in models:
            for devices in counts:
                runs = {}
                for secure in (False, True):
                    name = f"{model}-{devices}-{'secure' if secure else 'plain'}"
                    config = bench_config(algorithm="fedavg", model="auto" if model == "quick" else model,
                                          clients=devices, min_clients=devices, rounds=args.rounds,
                                          local_epochs=args.local_epochs, batch_size=args.batch_size,
                                          workers=args.workers, seed=args.seed, device="cpu",
                                          secure_aggregation=secure, secagg_degree=args.secagg_degree,
                                          secagg_threshold=args.secagg_threshold, secagg_clip=args.secagg_clip,
                                          out=str(workdir / name), broker=url, mqtt_protocol=protocol,
                                          federation=f"secagg-{uuid.uuid4().hex[:8]}", **sources[model])
                    log.info("%s ...", name)
                    runs[secure] = run_one(config)
                    runs[secure]["total_weight"] = total_weight(config)
                    log.info("%s: %s s per round", name,
                             ", ".join(f"{r['seconds']:.1f}" for r in runs[secure]["rounds"]))
                rows.append(compare_pair(model, devices, runs[False], runs[True], args.secagg_clip))
                on_row(rows)
    return rows


def total_weight(config) -> float:
    """The secure sum's total weight: each device's examples over the round's scale, the largest
    power of two its devices said bounds their examples (`examples_bucket`), summed."""
    from edge_sdk.privacy.disclosure import examples_bucket

    examples = [config.run.client_data(i, config.training.seed).num_train for i in range(config.run.clients)]
    scale = max(2 ** examples_bucket(e) for e in examples)
    return sum(e / scale for e in examples)


# -- in process ------------------------------------------------------------------------------------
def inprocess_round(devices: int, length: int, dropped: int, degree: int, threshold_fraction: float,
                    clip: float, seed: int) -> dict[str, Any]:
    """One round of `devices` on `length`-element vectors in which `dropped` devices (the last
    ones by id) stop after sharing keys: the exactness of the sum and the stages' seconds."""
    from edge_sdk.privacy.secagg_settings import SecAggSettings
    from edge_sdk.secagg import IdentityKey, RoundContext, Roster, SecAggClient, SecAggServer
    from edge_sdk.secagg.errors import RoundFailed, SecAggError
    from edge_sdk.secagg.fixedpoint import FixedPoint
    from edge_sdk.secagg.graph import effective_degree

    ids = [f"dev{i:03d}" for i in range(devices)]
    keys = {device: IdentityKey.generate() for device in ids}
    roster = Roster({device: key.public_hex() for device, key in keys.items()})
    used = effective_degree(devices, degree)
    threshold = SecAggSettings(secagg_threshold=threshold_fraction).threshold_for(used)
    context = RoundContext("bench", 1, tuple(ids), threshold, degree, None, length)
    server = SecAggServer(context)
    clients = {device: SecAggClient(device, keys[device], roster, context) for device in ids}
    quantizer = FixedPoint(max(clip, 1.0), devices)
    stage_seconds: dict[str, float] = {"advertise": 0.0, "share_keys": 0.0, "receive_shares": 0.0, "mask": 0.0,
                                       "confirm": 0.0, "unmask": 0.0}

    def timed(stage: str, call, *arguments):
        began = time.perf_counter()
        value = call(*arguments)
        stage_seconds[stage] += time.perf_counter() - began
        return value

    def quantized(device: str) -> np.ndarray:  # regenerated where needed: no n x length copies held
        rng = np.random.default_rng([seed, ids.index(device)])
        return quantizer.encode(rng.normal(0.0, 0.01, length), rng)

    for device in ids:
        server.add_advertisement(timed("advertise", clients[device].advertise))
    adverts = server.advertisements()
    for device in ids:
        server.route(device, timed("share_keys", clients[device].share_keys, adverts))
    for device in ids:
        timed("receive_shares", clients[device].receive_shares, server.inbox(device))
    survivors = ids[:devices - dropped]
    for device in survivors:
        server.add_masked(device, timed("mask", clients[device].mask, quantized(device)))
    listed = server.survivor_set()
    for device in survivors:
        server.add_signature(timed("confirm", clients[device].confirm, listed))
    refused = 0
    for device in survivors:
        request = server.unmask_request(device)
        try:
            server.add_unmask_response(timed("unmask", clients[device].unmask, request.survivors, request.dropped,
                                             request.signatures))
        except SecAggError:
            refused += 1
    began = time.perf_counter()
    try:
        total = server.result()
    except RoundFailed as exc:
        return {"devices": devices, "length": length, "dropped": dropped, "threshold": threshold, "degree": used,
                "failed": str(exc), "exact": None, "unmask_seconds": time.perf_counter() - began,
                "refused_unmask": refused, "device_seconds": {k: v / devices for k, v in stage_seconds.items()}}
    unmask_seconds = time.perf_counter() - began
    expected = np.zeros(length, dtype=np.uint32)
    for device in survivors:
        expected += quantized(device)
    return {"devices": devices, "length": length, "dropped": dropped, "threshold": threshold, "degree": used,
            "failed": None, "exact": bool(np.array_equal(total, expected)), "unmask_seconds": unmask_seconds,
            "refused_unmask": refused,
            "device_seconds": {stage: seconds / (len(survivors) if stage in ("mask", "confirm", "unmask") else devices)
                               for stage, seconds in stage_seconds.items()}}


def inprocess_part(args, lengths: dict[str, int], on_row) -> list[dict]:
    """The in-process rounds of every model length, graph degree and number of dropouts; `on_row`
    sees each row."""
    rows: list[dict] = []
    for model, length in lengths.items():
        for degree in args.inprocess_degrees:
            for dropped in args.dropouts:
                log.info("in process: %s (%d elements), degree %d, %d of %d dropped ...", model, length, degree,
                         dropped, args.inprocess_devices)
                row = inprocess_round(args.inprocess_devices, length, dropped, degree, args.secagg_threshold,
                                      args.secagg_clip, args.seed)
                rows.append({"model": model, **row})
                on_row(rows)
    return rows


# -- the report ------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"FedAvg, {s['rounds']} round(s) x {s['local_epochs']} local epoch (batch {s['batch_size']}), "
             f"{s['workers']} device worker processes, seed {s['seed']}, float64 sums, secure aggregation with "
             f"degree {s['secagg_degree']}, threshold {s['secagg_threshold']}, clip {s['secagg_clip']}; data: "
             f"{s['data']}", "",
             "## Over the broker: secure / plain, per round", "",
             "| model | parameters | devices | MB up plain | MB up secure | up ratio | MB down plain | MB down secure "
             "| down ratio | round s plain | round s secure | round ratio | train+protocol s plain | train+protocol s "
             "secure | evaluation s plain / secure | all unmasked |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["broker"]:
        lines.append(
            f"| {row['model']} | {row['parameters']:,} | {row['devices']} | {row['plain_bytes_up'] / 1e6:.2f} "
            f"| {row['secure_bytes_up'] / 1e6:.2f} | {row['bytes_up_ratio']:.3f} "
            f"| {row['plain_bytes_down'] / 1e6:.2f} | {row['secure_bytes_down'] / 1e6:.2f} "
            f"| {row['bytes_down_ratio']:.3f} | {row['plain_seconds']:.1f} | {row['secure_seconds']:.1f} "
            f"| {row['seconds_ratio']:.2f} | {row['plain_train_seconds']:.1f} "
            f"| {row['secure_train_seconds']:.1f} | {row['plain_evaluation_seconds']:.1f} / "
            f"{row['secure_evaluation_seconds']:.1f} | {'yes' if row['unmasked_all'] else 'no'} |")
    lines += ["", "MB: per round, over all rounds (evaluation included, the same in both). Seconds: per round, over "
              "the rounds after the first when there are more (the first also warms the worker processes up); "
              "train+protocol: the round's start to the end of its aggregation.", "",
              "## Secure rounds by stage (seconds per round, the coordinator's view)", "",
              "| model | devices | advertise keys | share keys | train, mask, upload | unmask and fold | plain: train, "
              "upload, fold |", "|---|---|---|---|---|---|---|"]
    for row in result["broker"]:
        stage = row["secure_stage_seconds"]
        if stage:
            lines.append(f"| {row['model']} | {row['devices']} | {stage['advertise']:.2f} | {stage['share']:.2f} "
                         f"| {stage['train']:.2f} | {stage['unmask']:.2f} | {row['plain_train_seconds']:.2f} |")
    lines += ["", "## Quantization: secure global model against the plain one", "",
              "| model | devices | error bound per summand | bound on the sum (x devices) | total weight "
              "| bound on the model | measured max abs difference | coordinates beyond bound + 1 float32 ulp |",
              "|---|---|---|---|---|---|---|---|"]
    for row in result["broker"]:
        q = row["quantization"]
        lines.append(f"| {row['model']} | {row['devices']} | {q['max_error_per_summand']:.3g} | {q['sum_bound']:.3g} "
                     f"| {q['total_weight']:.2f} | {q['model_bound']:.3g} | {q['max_abs_difference']:.3g} "
                     f"| {q['outside_bound']} of {q['coordinates']:,} |")
    lines += ["", "The bound is that of one aggregation from the same model; with more rounds than one, local training "
              "from the two slightly different models amplifies the difference.",
              "", f"## In process: {s['inprocess_devices']} devices, some stopping after key sharing", "",
              "| model | vector length | dropped | threshold of degree | exact survivors' sum | server unmasking s "
              "| per device s: advertise / share / receive / mask / unmask |", "|---|---|---|---|---|---|---|"]
    for row in result["inprocess"]:
        d = row["device_seconds"]
        outcome = (f"round failed: too few shares for {row['failed'].count(' shares)')} secrets "
                   f"({row['refused_unmask']} survivors refused to unmask)" if row["failed"]
                   else "yes" if row["exact"] else "NO")
        lines.append(f"| {row['model']} | {row['length']:,} | {row['dropped']} of {row['devices']} "
                     f"| {row['threshold']} of {row['degree']} | {outcome} | {row['unmask_seconds']:.2f} "
                     f"| {d['advertise']:.4f} / {d['share_keys']:.4f} / {d['receive_shares']:.4f} / {d['mask']:.3f} "
                     f"/ {d['unmask']:.4f} |")
    t = result["targets"]
    lines += ["", "## Targets", ""]
    def verdict(value: float, target: float) -> str:
        return f"{value:.2f}x (target <= {target}: {'met' if value <= target else 'missed'})"

    for row in result["broker"]:
        if row["devices"] == t["at_devices"]:
            lines.append(f"- {row['model']}, {row['devices']} devices: bytes up "
                         f"{verdict(row['bytes_up_ratio'], t['bytes_up_ratio'])}, round time "
                         f"{verdict(row['seconds_ratio'], t['round_seconds_ratio'])}")
    if not any(row["devices"] == t["at_devices"] for row in result["broker"]):
        lines.append(f"- no run at {t['at_devices']} devices in this invocation")
    runs = result.get("machine_broker")
    if runs:
        lines += ["", f"Runs over the broker: {runs['date']}, load average at start {runs['load_average_at_start']}, "
                  f"command `{runs['command']}`; the in-process rounds below that."]
    m = result["machine"]
    lines += ["", f"Machine: {m['date']}, {m['cpu_model']}, {m['cores']} cores, {m['ram_gib']} GiB; load average "
              f"at start {m['load_average_at_start']}. Command: `{m['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits, 4 devices, 1 round; in process 10 devices on 1,000-element vectors")
    add_run_flags(parser, ("rounds", "local_epochs", "batch_size", "workers", "seed", "secagg_degree",
                           "secagg_threshold", "secagg_clip"),
                  {"rounds": 1, "local_epochs": 1, "workers": 2, "seed": 0})
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: cnn28 (digits at 28x28), cnn32 "
                        "(digits at 32x32 RGB)")
    parser.add_argument("--devices", default=",".join(map(str, DEVICE_COUNTS)), help="comma-separated device counts")
    parser.add_argument("--inprocess-devices", type=int, default=50, help="devices of the in-process rounds")
    parser.add_argument("--inprocess-degrees", default=None,
                        help="comma-separated graph degrees of the in-process rounds (default: --secagg-degree, and "
                             "the full graph, devices - 1, where that is larger)")
    parser.add_argument("--inprocess-only", action="store_true",
                        help="run the in-process rounds only, keeping the runs over the broker of OUT/secagg.json")
    parser.add_argument("--dropouts", default=",".join(map(str, DROPOUTS)),
                        help="comma-separated numbers of in-process devices that stop after key sharing")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        raise SystemExit(f"error: --models: unknown {', '.join(unknown)} (cnn28, cnn32)")
    args.devices = [int(n) for n in args.devices.split(",") if n]
    args.dropouts = [int(n) for n in args.dropouts.split(",") if n]
    if args.quick:
        args.inprocess_devices, args.dropouts = 10, [0, 1, 3]
    args.inprocess_degrees = ([int(n) for n in args.inprocess_degrees.split(",") if n] if args.inprocess_degrees
                              else [args.secagg_degree] + [args.inprocess_devices - 1] * (
                                  args.inprocess_devices - 1 > args.secagg_degree))
    setup_logging()
    out = Path(args.out)
    result: dict[str, Any] = {
        "machine": machine_info(), "targets": TARGETS,
        "settings": {"quick": args.quick, "models": args.models, "devices": [4] if args.quick else args.devices,
                     "rounds": args.rounds, "local_epochs": args.local_epochs, "batch_size": args.batch_size,
                     "workers": args.workers, "seed": args.seed, "secagg_degree": args.secagg_degree,
                     "secagg_threshold": args.secagg_threshold, "secagg_clip": args.secagg_clip,
                     "inprocess_devices": args.inprocess_devices, "dropouts": args.dropouts,
                     "inprocess_degrees": args.inprocess_degrees,
                     "data": "digits (cnn8)" if args.quick else
                     "the 1,797 digits split among the devices, drawn at 28x28 grey for cnn28 and at 32x32 RGB "
                     "(tinted) for cnn32",
                     "broker": args.broker or "mosquitto"},
        "broker": [], "inprocess": []}

    def save(**part: list[dict]) -> None:  # after every row, so that an interrupted run keeps what it measured
        result.update(part)
        write(out, result)

    if args.inprocess_only:
        previous = json.loads((out / "secagg.json").read_text())
        result.update(machine_broker=previous["machine"], settings=previous["settings"], broker=previous["broker"])
        result["settings"].update(inprocess_devices=args.inprocess_devices, dropouts=args.dropouts,
                                  inprocess_degrees=args.inprocess_degrees)
        rows = previous["broker"]
    else:
        with tempfile.TemporaryDirectory(prefix="edgepfl-secagg-") as workdir:
            rows = broker_part(args, Path(workdir), lambda rows: save(broker=rows))
    lengths = ({"quick": QUICK_LENGTH} if args.quick else  # the secure vector: every floating value and the weight
               {row["model"]: row["parameters"] + 1 for row in rows})
    save(inprocess=inprocess_part(args, lengths, lambda rows: save(inprocess=rows)))
    print(markdown(result))


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "secagg.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "secagg.md").write_text(markdown(result))

if __name__ == "__main__":
    main()

"""The compatibility matrix: every algorithm against every run feature, and what a run of each does.

A feature (`FEATURES`) is a set of run settings plus what the matrix runner (tests/matrix.py)
does around the run: a warm start's source, weak devices with a head, a restart. A cell is an
algorithm with a feature; it either runs to its end or is refused at start, before anything
trains, with the one-line ConfigError the coordinator gives (`refusal`). The refusal is not
declared here: it is what constructing a Coordinator of the cell's run raises, so the table
follows the algorithms' declarations (`asynchronous`, `unshardable`, `shares_body`, upload
kinds, DP-SGD and capability checks) as they change. `python -m coordinator.compatibility
--write docs/COMPATIBILITY.md` regenerates the docs table; a test checks it is current.

Nothing heavy loads at import: `refusal` builds the run's model (torch) when called.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASE: Mapping[str, Any] = {"dataset": "digits", "clients": 4, "rounds": 2, "local_epochs": 1, "batch_size": 64,
                           "seed": 0, "device": "cpu"}
"""The run every cell varies: digits and its default model, four devices, two rounds."""

PRIVATE = {"dp_clip": 0.5, "dp_noise": 0.3, "dp_delta": 1e-5, "dp_evaluation": "outside"}
"""The DP settings of a `--dp` cell: little noise, so that two rounds still learn."""

LITE = {"release": True, "lite_fraction": 0.25}
"""A release to weak devices: the last of the four devices is a LiteClient."""

SECURE = {"secure_aggregation": True, "aggregation_dtype": "float64"}


@dataclass(frozen=True)
class Feature:
    """A column of the matrix: run settings (flat RunConfig keys) and what the runner adds.

    `init_from`: the warm start's source the runner writes (`run`: a finished run's folder of
    the same algorithm, `state_dict`: a torch state_dict of the model, `npz`: its arrays);
    `restart`: `coordinator` (stopped after round 1, a new one on the same run folder) or
    `device` (a device's connection lost as it sends its first update, made again at once);
    `availability`: an `--availability` trace file's text (device,offline,online in seconds)
    the runner writes and plays, taking devices offline and back over the loopback broker."""

    name: str
    what: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    restart: str | None = None
    availability: str | None = None


FEATURES: tuple[Feature, ...] = (
    Feature("plain", "two synchronous rounds"),
    Feature("init-run", "`--init-from` a finished run's folder", init_from="run"),
    Feature("init-pt", "`--init-from` a state_dict (.pt)", init_from="state_dict"),
    Feature("init-npz", "`--init-from` arrays (.npz)", init_from="npz"),
    Feature("async", "`--mode async`", {"mode": "async", "buffer": 2, "concurrency": 3}),
    Feature("secagg", "`--secure-aggregation`", SECURE),
    Feature("dp-central", "`--dp central`", {"dp": "central", **PRIVATE}),
    Feature("dp-local", "`--dp local` with noise 0.05: each update carries its own noise, and four devices average "
            "little of it away", {"dp": "local", **PRIVATE, "dp_noise": 0.05}),
    Feature("dp-distributed", "`--dp distributed` with `--secure-aggregation`", {"dp": "distributed", **PRIVATE,
                                                                                  **SECURE}),
    Feature("dp-sgd", "`--dp-sgd` (on-device DP-SGD) on model mlp: cnn8's BatchNorm has no per-example gradients",
            {"dp_sgd": True, "model": "mlp", "dp_sgd_noise": 0.3, "dp_sgd_clip": 1.0}),
    Feature("shards", "`--shards 2`, two in-process aggregators", {"shards": 2}),
    Feature("release-svm", "`--release`, a weak device with head svm", {**LITE, "head": "svm"}),
    Feature("release-lr", "`--release`, a weak device with head lr", {**LITE, "head": "lr"}),
    Feature("release-mlp", "`--release`, a weak device with head mlp", {**LITE, "head": "mlp"}),
    Feature("release-ncm", "`--release`, a weak device with head ncm (prototypes)", {**LITE, "head": "ncm"}),
    Feature("fp16", "`--upload-codec fp16`", {"upload_codec": "fp16"}),
    Feature("int8", "`--upload-codec int8`", {"upload_codec": "int8"}),
    Feature("q4", "`--upload-codec q4`", {"upload_codec": "q4"}),
    Feature("q2", "`--upload-codec q2`", {"upload_codec": "q2"}),
    Feature("topk", "`--upload-codec topk --topk-fraction 0.1` (error feedback on the devices)",
            {"upload_codec": "topk", "topk_fraction": 0.1}),
    Feature("topk+secagg", "`--upload-codec topk` with `--secure-aggregation`: refused", {"upload_codec": "topk",
                                                                                        **SECURE}),
    Feature("downlink-fp16", "`--downlink-codec fp16`: TRAIN carries the change since the last one",
            {"downlink_codec": "fp16"}),
    Feature("downlink-int8", "`--downlink-codec int8`: TRAIN carries the change since the last one",
            {"downlink_codec": "int8"}),
    Feature("resume-coord", "the coordinator stopped after round 1 and resumed", restart="coordinator"),
    Feature("resume-device", "a device's connection lost with its first update", restart="device"),
    Feature("late", "`--late-updates next_round`", {"late_updates": "next_round"}),
    Feature("availability", "`--availability` a trace: device 1 offline from 0.3 s to 1.5 s, device 2 from 1 s "
            "to 2 s", availability="device,offline,online\n1,0.3,1.5\n2,1.0,2.0\n"),
    Feature("validation", "`--validation-fraction 0.2`", {"validation_fraction": 0.2}),
    Feature("secagg+shards", "`--secure-aggregation` with `--shards 2` over six devices (three a shard at least "
            "on average: a shard's masked sum needs three)", {**SECURE, "shards": 2, "clients": 6}),
    Feature("async+release", "`--mode async` with a release to a weak device",
            {"mode": "async", "buffer": 2, "concurrency": 2, **LITE}),
    Feature("init+release", "`--init-from` a run's folder with a release to a weak device", LITE, init_from="run"),
)
"""The columns, in the docs table's order; names are unique."""

FEATURE_BY_NAME = {feature.name: feature for feature in FEATURES}

KNOWN_FAILURES: Mapping[tuple[str, str], str] = {}
"""Cells that start but do not complete, by (algorithm, feature), with what happens: the table
shows them as failing, and the matrix test expects them to fail until they are fixed."""


def algorithm_ids() -> tuple[str, ...]:
    """The rows: every registered algorithm id."""
    from edge_sdk.algorithms import ALGORITHM_IDS

    return tuple(ALGORITHM_IDS)


def cell_settings(algorithm: str, feature: Feature, out: str | Path) -> dict[str, Any]:
    """The flat RunConfig keys of the cell's run, writing into `out`."""
    return {**BASE, **feature.settings, "algorithm": algorithm, "out": str(out)}


def refusal(algorithm: str, feature: Feature) -> str | None:
    """The ConfigError a run of the cell is refused with at start (its message, `without_folders`),
    or None when it starts: the settings and a Coordinator built on them, over an in-memory
    broker, into a scratch folder. A warm start reads `write_source`'s file, or for a run
    folder the checkpoint of the plain cell's initial state (the arrays a finished run holds);
    an availability trace is the runner's to play and refuses nothing here."""
    from edge_sdk.config import ConfigError

    with tempfile.TemporaryDirectory() as scratch:
        try:
            settings = cell_settings(algorithm, feature, Path(scratch) / "run")
            if feature.init_from == "run":
                settings["init_from"] = str(_initial_run(algorithm, Path(scratch) / "source"))
            elif feature.init_from is not None:
                settings["init_from"] = str(write_source(algorithm, feature, Path(scratch)))
            _coordinator(settings)
        except ConfigError as exc:
            return without_folders(str(exc))
    return None


def _coordinator(settings: Mapping[str, Any]):
    """A Coordinator of the run `settings` name, over an in-memory broker."""
    from edge_sdk.channel import Channel
    from edge_sdk.loopback import LoopbackBroker
    from edge_sdk.protocol import Topics

    from .config.run_config import RunConfig
    from .server import Coordinator

    config = RunConfig.of(**settings)
    transport = LoopbackBroker().transport("coordinator")
    transport.connect()
    return Coordinator(config, Channel(transport, Topics(config.broker.federation)))


def _initial_run(algorithm: str, out: Path) -> Path:
    """A run folder holding the plain cell's initial global state as its checkpoint."""
    from .run import checkpoint

    coordinator = _coordinator(cell_settings(algorithm, FEATURES[0], out))
    checkpoint.save(coordinator.folder.checkpoint, checkpoint.Checkpoint(
        coordinator.run_id, 1, coordinator.config.fingerprint(), coordinator.algorithm.state))
    return out


def write_source(algorithm: str, feature: Feature, folder: Path) -> Path:
    """The warm start of a `state_dict` or `npz` cell, written into `folder`: the cell's model
    (seed 1) as a torch state_dict (pretrained.pt) or as named arrays (pretrained.npz)."""
    import numpy as np
    import torch

    from edge_sdk.models import build_model

    from .config.run_config import RunConfig

    config = RunConfig.of(**cell_settings(algorithm, feature, folder))
    state = build_model(config.model_name, config.task(), seed=1).state_dict()
    if feature.init_from == "state_dict":
        path = folder / "pretrained.pt"
        torch.save(state, path)
    else:
        path = folder / "pretrained.npz"
        np.savez(path, **{name: tensor.numpy() for name, tensor in state.items()})
    return path


def without_folders(message: str) -> str:
    """`message` with the folders of its absolute paths left out (the file names stay): a
    refusal reads the same whichever scratch folder the run wrote into."""
    return re.sub(r"(?<![\w.])/(?:[^\s/:'\"]+/)+", "", message)


def short_reason(message: str) -> str:
    """What a docs cell shows of a refusal: its message up to the first colon (the key it names)."""
    return message.split(":", 1)[0].strip()


def table(refusals: Mapping[tuple[str, str], str | None]) -> str:
    """The docs table (Markdown): a row per algorithm, a column per feature, `yes` or `refused:
    <key> [n]`, then the features and the numbered refusals in full."""
    algorithms = list(dict.fromkeys(algorithm for algorithm, _ in refusals))
    messages = list(dict.fromkeys(message for message in refusals.values() if message is not None))
    number = {message: i + 1 for i, message in enumerate(messages)}
    failures = list(dict.fromkeys(why for cell, why in KNOWN_FAILURES.items() if cell in refusals))

    def cell(algorithm: str, feature: Feature) -> str:
        message = refusals[algorithm, feature.name]
        if message is not None:
            return f"refused: {short_reason(message)} [{number[message]}]"
        failure = KNOWN_FAILURES.get((algorithm, feature.name))
        return "yes" if failure is None else f"fails [F{failures.index(failure) + 1}]"

    lines = ["| algorithm | " + " | ".join(f.name for f in FEATURES) + " |",
             "|---|" + "---|" * len(FEATURES)]
    lines += [f"| `{a}` | " + " | ".join(cell(a, f) for f in FEATURES) + " |" for a in algorithms]
    lines += ["", "| feature | the run |", "|---|---|"]
    lines += [f"| {f.name} | {f.what} |" for f in FEATURES]
    lines += ["", "Refusals, in full (the ConfigError the run stops with):", ""]
    lines += [f"{number[m]}. {m}" for m in messages]
    if failures:
        lines += ["", "Cells that start but do not complete:", ""]
        lines += [f"- F{i + 1}: {why}" for i, why in enumerate(failures)]
    return "\n".join(lines) + "\n"


BEGIN = "<!-- generated by python -m coordinator.compatibility --write docs/COMPATIBILITY.md: do not edit -->"
END = "<!-- end of the generated table -->"


def all_refusals() -> dict[tuple[str, str], str | None]:
    """`refusal` of every cell, by (algorithm, feature name)."""
    return {(algorithm, feature.name): refusal(algorithm, feature)
            for algorithm in algorithm_ids() for feature in FEATURES}


def with_table(document: str, generated: str) -> str:
    """`document` with the part between BEGIN and END replaced by `generated`."""
    head, found, rest = document.partition(BEGIN)
    if not found or END not in rest:
        raise ValueError(f"the document has no {BEGIN!r} ... {END!r} section")
    return f"{head}{BEGIN}\n{generated}{END}{rest.partition(END)[2]}"


def main(argv: list[str] | None = None) -> int:
    """Write the table into a document's generated section (`--write PATH`) or print it."""
    import logging

    parser = argparse.ArgumentParser(prog="python -m coordinator.compatibility", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="PATH", help="the document whose generated section to replace")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # a refused cell logs nothing worth reading here
    generated = table(all_refusals())
    if args.write is None:
        sys.stdout.write(generated)
        return 0
    path = Path(args.write)
    path.write_text(with_table(path.read_text(), generated))
    return 0


if __name__ == "__main__":
    sys.exit(main())

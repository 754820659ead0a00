"""The coordinator's settings sections: what a run is, how its rounds go, how it is simulated.

Together with `edge_sdk.settings.TrainSettings` (training), `edge_sdk.settings.BrokerSettings`
(broker) and `coordinator.aggregation.robust.AggregationSettings` (aggregation) they make up a RunConfig.
Each field is declared once with `setting(...)`; flags, TOML keys and the fingerprint follow.
Only light modules are imported, so `edgepfl --help` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from edge_sdk.config import ConfigError
from edge_sdk.settings import ALL_COMMANDS, DEFINES, DEFINES_IF_SET, RUN_COMMANDS, check, setting

DEFAULT_DATASET = "digits"
"""The dataset of a run that names neither `dataset` nor `data`."""
HEADS = ("svm", "lr", "mlp", "ncm")
MODES = ("sync", "async")
"""Synchronous rounds, or buffered asynchronous aggregation (coordinator/rounds/async_steps.py)."""
LATE_POLICIES = ("discard", "next_round")
"""What happens to an update that arrives after its round closed (coordinator.rounds.collector.LateUpdates)."""


@dataclass(frozen=True)
class RunSettings:
    """What the run is: the algorithm, the data and how it is split among the devices (`[run]`)."""

    commands: ClassVar[tuple[str, ...]] = RUN_COMMANDS

    algorithm: str = setting("fedavg", defines=DEFINES, help="algorithm id (fedavg, fedrep, repper, ...)")
    dataset: str | None = setting(None, defines=DEFINES, commands=ALL_COMMANDS,
                                  shown_default=f"{DEFAULT_DATASET} unless --data is given",
                                  help="a built-in dataset: digits | fmnist | mnist | cifar10 | cifar100")
    data: str | None = setting(None, defines=DEFINES_IF_SET, commands=ALL_COMMANDS,
                               help="your own data instead of --dataset: an .npz with x and y, a .csv with a label "
                                    "column or an ImageFolder directory")
    data_dir: str | None = setting(None, commands=ALL_COMMANDS,
                                   shown_default="system locations, then a download",
                                   help="where the built-in datasets' files are")
    partition: str = setting("iid", defines=DEFINES, commands=ALL_COMMANDS,
                             help="iid | dirichlet | shards | domains")
    alpha: float = setting(0.5, defines=DEFINES, commands=ALL_COMMANDS,
                           help="Dirichlet concentration (partition=dirichlet)")
    classes_per_client: int = setting(2, defines=DEFINES, commands=ALL_COMMANDS,
                                      help="classes per device (partition=shards)")
    clients: int = setting(10, defines=DEFINES, commands=ALL_COMMANDS,
                           help="number of devices (devices: number of partitions of --dataset)")
    release: bool = setting(False, help="export and publish the global body after training (RepPer always does; "
                                        "algorithms that keep BatchNorm statistics personal first pool the global "
                                        "body's from the trainers; refused for a personal body: local, lg_fedavg)")
    init_from: str | None = setting(None, defines=DEFINES_IF_SET,
                                    help="start a new run from another model's global arrays, matched by name: a "
                                         "run folder (its checkpoint.msgpack), a checkpoint.msgpack, a PyTorch "
                                         "state_dict (.pt, .pth) or an .npz of named arrays; another shape is "
                                         "refused by name (a resumed run keeps its own checkpoint)")
    """Defines the run by its path (only when set, so other runs keep their fingerprint): the path,
    not the file's sha256, so that `edgepfl workers` on another host, which checks its settings
    against the coordinator's, needs the same flag but not the file. Two runs from different
    initial models must not be resumed as one (the second would continue the first's rounds and
    report a start it never had), so the sha256 of what a run started from is recorded in its
    checkpoint and a resume is refused when the file at that path has changed since
    (`coordinator.run.warm_start.apply`)."""
    out: str = setting("runs/latest", help="output folder (report.json, metrics.jsonl, curves.png, checkpoint)")

    def __post_init__(self) -> None:
        if self.dataset is not None and self.data is not None:
            raise ConfigError(f"give either dataset ({self.dataset!r}) or data ({self.data!r}), not both")
        if self.dataset is None and self.data is None:
            object.__setattr__(self, "dataset", DEFAULT_DATASET)
        check(self.alpha > 0, "alpha", "positive", self.alpha)
        check(self.clients >= 1, "clients", "at least 1", self.clients)
        check(self.init_from is None or bool(self.init_from.strip()), "init_from", "a path (or unset)",
              self.init_from)

    def client_data(self, index: int | None, seed: int, declared: dict | None = None):
        """Device `index`'s partition of `dataset` or of the `data` file, or (no index) a device's
        own `data` file; `declared` is the run's `[task]` table."""
        from edge_sdk.data import load_client_data, load_folder_data

        if index is None:
            if self.data is None:
                raise ConfigError("give index (a partition of dataset) or data (the device's own data)")
            return load_folder_data(self.data, seed=seed, declared=declared)
        return load_client_data(self.dataset, data=self.data, num_clients=self.clients, index=index,
                                partition=self.partition, seed=seed, alpha=self.alpha,
                                classes_per_client=self.classes_per_client, data_dir=self.data_dir, declared=declared)


@dataclass(frozen=True)
class RoundSettings:
    """How each round goes: who is selected, how long it waits, what it accepts (`[round]`)."""

    commands: ClassVar[tuple[str, ...]] = RUN_COMMANDS

    fraction: float = setting(1.0, defines=DEFINES, help="fraction of devices selected per round")
    eval_every: int = setting(1, help="evaluate every N rounds (and after the last)")
    round_timeout: float = setting(120.0, help="seconds before a round closes with the replies it has")
    min_clients: int = setting(1, help="quorum: replies needed to aggregate a round")
    holdout_clients: int = setting(0, defines=DEFINES,
                                   help="devices never selected for training (they only personalize at evaluation)")
    quorum_grace: float = setting(10.0, help="seconds to wait for stragglers once the quorum replied, and for a "
                                             "device that went offline mid-round while the quorum needs it")
    patience: float = setting(3.0, help="the grace and the timeout grow to this many times the slowest reply "
                                        "measured so far, and round 1 waits for every selected device up to the "
                                        "timeout (0: the configured times as they are)")
    late_updates: str = setting("discard", help="discard | next_round: an update that arrives after its round "
                                                "closed is dropped (counted), or folded into the next round at "
                                                "half its weight")
    registration_timeout: float = setting(300.0, help="seconds to wait for --clients devices to register")
    max_examples: int = setting(1_000_000, help="reject updates that claim more training examples than this")
    max_update_norm: float = setting(0.0, help="reject updates that move the shared state further than this (0: off)")
    mode: str = setting("sync", defines=DEFINES_IF_SET,
                        help="sync: rounds that wait for the devices they selected | async: buffered asynchronous "
                             "aggregation (FedBuff): devices train whenever they are free, and every --buffer arrivals "
                             "make a new global state; --rounds counts these aggregation steps")
    buffer: int = setting(10, defines=DEFINES_IF_SET, help="async: arrivals folded into each new global state (K)")
    max_staleness: int = setting(10, defines=DEFINES_IF_SET,
                                 help="async: refuse (counted) an update computed on a global state more than this "
                                      "many versions old")
    concurrency: int = setting(0, help="async: most devices training at once (0: every online trainer)")
    staleness_exponent: float = setting(0.5, defines=DEFINES_IF_SET,
                                        help="async: an update of staleness t counts (1 + t)^-a times (FedBuff's "
                                             "polynomial weight, a = 0.5)")
    shards: int = setting(0, help="split aggregation over this many shard aggregators, each validating and summing "
                                  "its devices' updates (0: the coordinator aggregates): `edgepfl aggregator --shard "
                                  "k/K` processes, which simulate starts itself as --local-aggregators says")

    def __post_init__(self) -> None:
        check(0 < self.fraction <= 1, "fraction", "in (0, 1]", self.fraction)
        check(self.eval_every >= 1, "eval_every", "at least 1", self.eval_every)
        check(self.round_timeout > 0, "round_timeout", "positive", self.round_timeout)
        check(self.min_clients >= 1, "min_clients", "at least 1", self.min_clients)
        check(self.holdout_clients >= 0, "holdout_clients", "zero or more and fewer than clients", self.holdout_clients)
        check(self.quorum_grace >= 0, "quorum_grace", "zero or more", self.quorum_grace)
        check(self.patience >= 0, "patience", "zero (off) or more", self.patience)
        check(self.late_updates in LATE_POLICIES, "late_updates", "discard or next_round", self.late_updates)
        check(self.max_examples >= 1, "max_examples", "at least 1", self.max_examples)
        check(self.max_update_norm >= 0, "max_update_norm", "zero (off) or positive", self.max_update_norm)
        check(0 <= self.shards <= 1024, "shards", "between 0 (off) and 1024", self.shards)
        check(self.mode in MODES, "mode", "sync or async", self.mode)
        check(self.buffer >= 1, "buffer", "at least 1", self.buffer)
        check(self.max_staleness >= 0, "max_staleness", "zero or more", self.max_staleness)
        check(self.concurrency >= 0, "concurrency", "zero (every online trainer) or more", self.concurrency)
        check(self.staleness_exponent >= 0, "staleness_exponent", "zero or more", self.staleness_exponent)
        check(not (self.shards and self.late_updates == "next_round"), "late_updates",
              "discard when sharded (a late update reaches its shard's aggregator after the round's partial left)",
              self.late_updates)


@dataclass(frozen=True)
class SimulationSettings:
    """How `edgepfl simulate` hosts the devices: processes, accelerator, weak and adversarial
    devices, and the shard aggregators (`[simulation]`)."""

    commands: ClassVar[tuple[str, ...]] = ("simulate",)

    workers: int = setting(0, shown_default="one per core", help="device worker processes (0: one per core)")
    device: str = setting("auto", commands=("simulate", "client"),
                          help="auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps")
    amp: bool = setting(False, commands=("simulate", "client"), help="automatic mixed precision on CUDA devices")
    lite_fraction: float = setting(0.0, defines=DEFINES,
                                   help="this share of the devices are weak ones (ONNX Runtime + a numpy head)")
    head: str = setting("svm", defines=DEFINES, commands=("simulate", "lite-client"),
                        help="svm | lr | mlp | ncm: the weak devices' personal head")
    adversaries: int = setting(0, defines=DEFINES,
                               help="this many devices corrupt their uploads (robustness experiments)")
    attack: str = setting("sign_flip", defines=DEFINES, help="sign_flip | noise | nan | mixed (what adversaries do)")
    availability: str = setting("always", defines=DEFINES_IF_SET,
                                help="when each device is online: always | random:P[:PERIOD] (online a share P of "
                                     "the time, an online and an offline spell lasting PERIOD s together on average, "
                                     "60 unless given; seeded per device) | a CSV trace file device,offline,online "
                                     "(seconds)")
    speed_spread: float = setting(1.0, defines=DEFINES_IF_SET,
                                  help="trainers compute 1 to this many times slower than the machine (log-uniform, "
                                       "seeded per device); 1: all at the machine's speed")
    local_aggregators: str = setting("all", help="the shard aggregators (--shards) this command hosts, a process "
                                                 "each: shards like 0-1 or 0,2, all, or none (those left out run "
                                                 "on other hosts with `edgepfl aggregator --shard k/K`)")

    def __post_init__(self) -> None:
        check(self.workers >= 0, "workers", "zero (one per core) or more", self.workers)
        check(0 <= self.lite_fraction < 1, "lite_fraction", "in [0, 1)", self.lite_fraction)
        check(self.head in HEADS, "head", "svm, lr, mlp or ncm", self.head)
        check(self.adversaries >= 0, "adversaries", "between 0 and clients", self.adversaries)
        check(self.speed_spread >= 1, "speed_spread", "1 (all at the machine's speed) or more", self.speed_spread)

"""The `[privacy]` settings section: user-level DP of the uploads (DP-FedAvg) and record-level
DP of local training (DP-SGD). The coordinator announces them in STATUS and WELCOME, so a
device learns before its HELLO that a run is private and sends nothing its mechanism does not
cover. Declared once here; flags, TOML keys, WELCOME fields and the fingerprint follow."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..config import ConfigError
from ..settings import DEFINES_IF_SET, RUN_COMMANDS, check, setting

DP_MODES = ("off", "central", "local", "distributed")
ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("fixed", "poisson")
EVALUATIONS = ("private", "outside")
DELTA_CAP = 1e-5
"""The largest default delta, whatever the number of individuals."""
DELTA_SHARE = 0.01
"""The default delta is at most this over the number N of individuals it protects: delta * N, an
upper bound on the expected number of individuals a mechanism may expose outright, stays below
1 %."""


@dataclass(frozen=True)
class PrivacySettings:
    """Differential privacy of a run (`[privacy]`); off by default."""

    commands: ClassVar[tuple[str, ...]] = RUN_COMMANDS

    dp: str = setting("off", defines=DEFINES_IF_SET,
                      help="off | central | local | distributed: user-level DP of every upload (DP-FedAvg): each "
                           "device clips its change to --dp-clip and Gaussian noise is added by the coordinator to "
                           "each aggregate (central), by each device to its own upload (local), or in shares by the "
                           "devices under secure aggregation (distributed)")
    dp_clip: float = setting(0.1, defines=DEFINES_IF_SET,
                             help="C: the L2 bound of one device's upload (its change from the broadcast), --dp")
    dp_noise: float = setting(0.0, defines=DEFINES_IF_SET,
                              help="z: the noise multiplier (standard deviation z*C), --dp (0: calibrated from "
                                   "--dp-epsilon for the planned rounds)")
    dp_epsilon: float = setting(0.0, shown_default="none",
                                help="the run's privacy budget epsilon at --dp-delta: z is calibrated to spend it "
                                     "over the planned rounds (without --dp-noise), and a run whose next round "
                                     "would exceed it stops (a resume may give a larger one); 0: no budget")
    dp_delta: float = setting(0.0, defines=DEFINES_IF_SET, shown_default="min(1e-5, 0.01 / devices)",
                              help="delta of the (epsilon, delta) guarantee; must be below 1 over the number of "
                                   "devices (a run is refused otherwise), and should be far below it")
    dp_accountant: str = setting("rdp", defines=DEFINES_IF_SET,
                                 help="rdp | pld: Google's dp-accounting accountant (pld needs --dp-sampling poisson)")
    dp_sampling: str = setting("fixed", defines=DEFINES_IF_SET,
                               help="fixed | poisson: each round selects round(fraction x devices) uniformly "
                                    "(accounted as sampling without replacement, one device's data replaced), or "
                                    "each device independently with probability fraction (one device added or "
                                    "removed)")
    dp_adaptive_clip: bool = setting(False, defines=DEFINES_IF_SET,
                                     help="adapt C every round toward the --dp-clip-quantile of the devices' change "
                                          "norms (Andrew et al. 2021; dp central): each device says whether its "
                                          "change was within C, their count is noised and accounted; --dp-clip is "
                                          "where C starts")
    dp_clip_quantile: float = setting(0.5, defines=DEFINES_IF_SET,
                                      help="the share of devices whose change adaptive clipping keeps within C")
    dp_clip_lr: float = setting(0.2, defines=DEFINES_IF_SET,
                                help="adaptive clipping's step: C *= exp(-lr x (share within C - quantile))")
    dp_clip_count_noise: float = setting(0.0, defines=DEFINES_IF_SET, shown_default="expected participants / 20",
                                         help="standard deviation of the noise on the count of devices within C "
                                              "(adaptive clipping)")
    dp_evaluation: str = setting("private", defines=DEFINES_IF_SET,
                                 help="private | outside: under --dp, the devices report their accuracy alone, "
                                      "released only as a noised mean and accounted (central: the coordinator "
                                      "noises the sum; local: each device its own); or every figure as measured, "
                                      "marked outside the guarantee (experiments on data you own)")
    dp_eval_noise: float = setting(10.0, defines=DEFINES_IF_SET,
                                   help="noise multiplier of the sum of the devices' accuracies (each in [0, 1]) "
                                        "under --dp-evaluation private")
    dp_reproducible_noise: bool = setting(False, defines=DEFINES_IF_SET,
                                          help="draw DP noise and each round's selection from the run's seed so runs "
                                               "repeat (the guarantee then holds only against whoever does not know "
                                               "the seed: experiments); default: from the operating system's entropy")
    dp_sgd: bool = setting(False, defines=DEFINES_IF_SET,
                           help="record-level DP of local training: every trainer trains with DP-SGD (Poisson-"
                                "sampled batches, each example's gradient clipped to --dp-sgd-clip, Gaussian noise) "
                                "and reports its own epsilon at --dp-sgd-delta; algorithms whose local loss is not "
                                "a mean of per-example terms, and models with BatchNorm, are refused")
    dp_sgd_noise: float = setting(1.0, defines=DEFINES_IF_SET,
                                  help="z: DP-SGD's noise multiplier per step (standard deviation z x --dp-sgd-clip "
                                       "on the sum of the clipped per-example gradients), --dp-sgd")
    dp_sgd_clip: float = setting(1.0, defines=DEFINES_IF_SET,
                                 help="the L2 bound of one example's gradient in one DP-SGD step, --dp-sgd")
    dp_sgd_delta: float = setting(0.0, defines=DEFINES_IF_SET, shown_default="min(1e-5, 0.01 / examples)",
                                  help="delta of each device's record-level (epsilon, delta), --dp-sgd: must be "
                                       "below 1 over the device's number of training examples (a device with "
                                       "fewer refuses to join), and should be far below it")

    def __post_init__(self) -> None:
        check(self.dp in DP_MODES, "dp", "off, central, local or distributed", self.dp)
        check(math.isfinite(self.dp_clip) and self.dp_clip > 0, "dp_clip", "a positive finite norm", self.dp_clip)
        check(math.isfinite(self.dp_noise) and self.dp_noise >= 0, "dp_noise", "zero (calibrate) or positive",
              self.dp_noise)
        check(math.isfinite(self.dp_epsilon) and self.dp_epsilon >= 0, "dp_epsilon", "zero (none) or positive",
              self.dp_epsilon)
        check(0 <= self.dp_delta < 1, "dp_delta", "in [0, 1) (0: min(1e-5, 0.01 / devices))", self.dp_delta)
        check(self.dp_accountant in ACCOUNTANTS, "dp_accountant", "rdp or pld", self.dp_accountant)
        check(self.dp_sampling in SAMPLINGS, "dp_sampling", "fixed or poisson", self.dp_sampling)
        check(self.dp_evaluation in EVALUATIONS, "dp_evaluation", "private or outside", self.dp_evaluation)
        check(math.isfinite(self.dp_eval_noise) and self.dp_eval_noise > 0, "dp_eval_noise", "positive",
              self.dp_eval_noise)
        if self.dp != "off":
            check(self.dp_noise > 0 or self.dp_epsilon > 0, "dp_noise", "positive, or calibrated from dp_epsilon "
                  "(give --dp-noise or --dp-epsilon)", self.dp_noise)
        check(0 < self.dp_clip_quantile < 1, "dp_clip_quantile", "in (0, 1)", self.dp_clip_quantile)
        check(math.isfinite(self.dp_clip_lr) and self.dp_clip_lr > 0, "dp_clip_lr", "positive", self.dp_clip_lr)
        check(math.isfinite(self.dp_clip_count_noise) and self.dp_clip_count_noise >= 0, "dp_clip_count_noise",
              "zero (expected participants / 20) or positive", self.dp_clip_count_noise)
        check(math.isfinite(self.dp_sgd_noise) and self.dp_sgd_noise > 0, "dp_sgd_noise", "a positive finite "
              "noise multiplier", self.dp_sgd_noise)
        check(math.isfinite(self.dp_sgd_clip) and self.dp_sgd_clip > 0, "dp_sgd_clip", "a positive finite norm",
              self.dp_sgd_clip)
        check(0 <= self.dp_sgd_delta < 1, "dp_sgd_delta", "in [0, 1) (0: min(1e-5, 0.01 / examples))",
              self.dp_sgd_delta)
        check(not (self.dp_accountant == "pld" and self.dp_sampling == "fixed"), "dp_accountant",
              "rdp with dp_sampling fixed (dp-accounting's PLD accountant has no sampling without replacement; "
              "use dp_sampling poisson)", self.dp_accountant)

    @property
    def enabled(self) -> bool:
        """User-level DP of the uploads is on."""
        return self.dp != "off"

    def delta_for(self, devices: int) -> float:
        """The run's delta over `devices` devices: the given one, or `default_delta(devices)`;
        ConfigError naming dp_delta when the given one is not below 1 / devices."""
        return _delta(self.dp_delta, devices, "dp_delta", "devices")

    def dp_sgd_delta_for(self, examples: int) -> float:
        """A device's DP-SGD delta over its `examples` training examples: the given one, or
        `default_delta(examples)`; ConfigError naming dp_sgd_delta when the given one is not below
        1 / examples."""
        return _delta(self.dp_sgd_delta, examples, "dp_sgd_delta", "training examples")


def default_delta(individuals: int) -> float:
    """The default delta of a guarantee over `individuals` (devices, or a device's records):
    min(DELTA_CAP, DELTA_SHARE / individuals)."""
    return min(DELTA_CAP, DELTA_SHARE / max(1, individuals))


def _delta(given: float, individuals: int, key: str, what: str) -> float:
    """`given` (0: the default) checked against the 1 / `individuals` a delta must stay below: at
    delta >= 1 / N, a mechanism that publishes one individual's data outright is (0, delta)-DP."""
    if given == 0:
        return default_delta(individuals)
    if given * max(1, individuals) >= 1:
        raise ConfigError(f"{key} (--{key.replace('_', '-')}) {given:g} must be below 1 over the {individuals} "
                          f"{what} (1/N = {1 / max(1, individuals):.3g}), and should be far below it: leave it "
                          f"unset for min({DELTA_CAP:g}, {DELTA_SHARE:g} / N) = {default_delta(individuals):.3g}")
    return given

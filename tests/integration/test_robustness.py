"""20% adversarial devices: robust aggregation keeps accuracy; the plain mean does not.

15 devices on digits, three of them adversaries (sign flip x10, Gaussian noise, NaN), FedAvg
for 5 rounds over Mosquitto (devices evaluated after the last). The NaN upload is rejected by
validation in every run; the other two are what the aggregation rule must survive.
"""

from __future__ import annotations

import pytest

from coordinator.config.run_config import RunConfig
from coordinator.hosting.simulate import run_simulation

pytestmark = pytest.mark.integration


def accuracy(url: str, out, **settings) -> tuple[float, dict]:
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=15, rounds=5, seed=3, broker=url, workers=1,
                          out=str(out), round_timeout=120,
                          eval_every=5, **settings)  # only the final accuracy is read: no evaluation in between
    report = run_simulation(config)
    return report["final"]["personalized_accuracy"]["mean"], report


def test_robust_rules_survive_twenty_percent_adversaries(mosquitto, tmp_path):
    attacked = {"adversaries": 3, "attack": "mixed"}

    clean, _ = accuracy(mosquitto.url, tmp_path / "clean")
    plain, plain_report = accuracy(mosquitto.url, tmp_path / "mean", **attacked)
    median, _ = accuracy(mosquitto.url, tmp_path / "median", aggregation="median", **attacked)
    trimmed, _ = accuracy(mosquitto.url, tmp_path / "trimmed", aggregation="trimmed_mean", trim_fraction=0.2,
                          **attacked)

    assert clean >= 0.9
    assert plain < clean - 0.2, f"the plain mean should break: clean {clean:.3f}, attacked {plain:.3f}"
    assert median >= clean - 0.03, f"median {median:.3f} vs clean {clean:.3f}"
    assert trimmed >= clean - 0.03, f"trimmed mean {trimmed:.3f} vs clean {clean:.3f}"
    assert plain_report["rejections"].get("non_finite", 0) == 5, "the NaN device is rejected every round"

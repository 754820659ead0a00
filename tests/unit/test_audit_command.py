"""`edgepfl audit-privacy` end to end in this process: the run's DP flags, the table and the
verdict line, `--out`'s JSON, exit code 0 for the mechanism as built and 1 (one line saying so) when
its noise is switched off by the tests' switch, and the same figures from the same command.

A tiny model (`user_models:tiny_mlp` on digits) and 200 devices over 2 rounds keep each run short."""

from __future__ import annotations

import json

import pytest

from coordinator.cli import main
from coordinator.commands.audit_privacy import NOISE_SCALE_VARIABLE

COMMAND = ["audit-privacy", "--dp", "central", "--dp-epsilon", "1", "--dp-delta", "1e-5", "--clients", "200",
           "--rounds", "2", "--fraction", "1", "--model", "user_models:tiny_mlp"]


def test_the_mechanism_as_built_passes_and_the_json_repeats(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"

    assert main([*COMMAND, "--out", str(first)]) == 0
    printed = capsys.readouterr().out
    assert main([*COMMAND, "--out", str(second)]) == 0

    assert first.read_text() == second.read_text()
    result = json.loads(first.read_text())["result"]
    assert result["mode"] == "central" and result["delta"] == 1e-5 and result["canaries"] == 100
    assert result["lower_bound"] < result["accountant_epsilon"] <= 1.0 and not result["violated"]
    header, rule, row, verdict = printed.splitlines()
    assert header.startswith("| mode | epsilon | delta | z | accountant epsilon | lower bound (95%) |")
    assert row.startswith("| central | 1 | 1e-05 |") and verdict.startswith("no violation found")


def test_a_mechanism_without_noise_is_reported_as_a_violation(monkeypatch, capsys):
    monkeypatch.setenv(NOISE_SCALE_VARIABLE, "0")

    code = main(COMMAND)

    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert lines[2].startswith("| central (noise x0) |")
    (verdict,) = [line for line in lines if "VIOLATION" in line]
    assert "does not keep its claim" in verdict


@pytest.mark.parametrize("flags, named", [(["--dp", "off"], "dp must be central, local or distributed"),
                                          (["--canaries", "300"], "canaries must be between 1 and clients"),
                                          (["--dp-clip", "-1"], "dp_clip must be")])
def test_a_plan_outside_the_audit_is_refused_by_name(flags, named, capsys):
    assert main([*COMMAND, *flags]) == 2
    assert named in capsys.readouterr().err

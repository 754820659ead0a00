"""The command line fails fast and clearly: arguments are checked before torch is imported, the
password comes from a flag, a file or the environment, and every flag's help says its default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.cli import build_parser
from edge_sdk.algorithms import ALGORITHM_IDS
from edge_sdk.settings import PASSWORD_VARIABLE, BrokerSettings

ROOT = Path(__file__).resolve().parents[2]
LIGHT = ("torch", "torchvision", "sklearn", "onnxruntime", "amqtt")


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m coordinator.cli ARGS`, reporting at exit which heavy modules were imported."""
    probe = ("import atexit, sys, runpy; atexit.register(lambda: print('imported:', "
             f"sorted(m for m in {LIGHT!r} if m in sys.modules), file=sys.stderr)); "
             "sys.argv = ['edgepfl', *sys.argv[1:]]; runpy.run_module('coordinator.cli', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("args, named", [
    (["simulate", "--rounds", "0"], "rounds must be at least 1"),
    (["simulate", "--algorithm", "fedprox", "--set", "muu=0.1"], "unknown key 'muu' in [algorithm.fedprox]"),
    (["simulate", "--algorithm", "dc_pfl", "--set", "covariance=half"], "covariance must be"),
    (["coordinator", "--fraction", "2"], "fraction must be in (0, 1]"),
])
def test_bad_arguments_are_refused_before_torch_is_imported(args, named):
    # Execute
    started = time.monotonic()
    result = run_cli(*args)
    elapsed = time.monotonic() - started

    # Assert
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "imported: []" in result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 30  # torch alone takes longer on a loaded machine; the point is it is never imported


def test_hyperparameters_are_checked_without_importing_any_algorithm():
    # Prepare
    probe = ("import sys; from coordinator.algorithms import hyperparameters; "
             f"[hyperparameters(a, {{}}) for a in {ALGORITHM_IDS!r}]; "
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {LIGHT!r} "
             "or m.startswith(('edge_sdk.algorithms.', 'coordinator.algorithms.')) and '.hyper' not in m))")

    # Execute
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})

    # Assert
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("algorithm_id", ALGORITHM_IDS)
def test_the_torch_free_hyper_class_is_the_one_the_algorithms_use(algorithm_id):
    # Prepare
    from coordinator.algorithms import load as load_server
    from edge_sdk.algorithms import load as load_device
    from edge_sdk.algorithms.hyper import hyper_class

    # Execute
    hyper = hyper_class(algorithm_id)

    # Assert
    assert load_device(algorithm_id).Hyper is hyper
    assert load_server(algorithm_id).Hyper is hyper


def test_password_comes_from_the_flag_then_the_file_then_the_environment(tmp_path, monkeypatch):
    # Prepare
    secret = tmp_path / "password"
    secret.write_text("from-file\nignored second line\n")
    monkeypatch.setenv(PASSWORD_VARIABLE, "from-env")

    # Execute
    flag = BrokerSettings(username="cam-01", password="from-flag").mqtt_settings("cam-01")
    file = BrokerSettings(username="cam-01", password_file=str(secret)).mqtt_settings("cam-01")
    env = BrokerSettings(username="cam-01").mqtt_settings("cam-01")

    # Assert
    assert (flag.password, file.password, env.password) == ("from-flag", "from-file", "from-env")
    assert env.username == "cam-01"


def test_a_missing_password_file_is_named(tmp_path):
    # Prepare
    settings = BrokerSettings(username="cam-01", password_file=str(tmp_path / "absent"))

    # Execute
    with pytest.raises(ValueError, match="password_file .*absent"):
        settings.mqtt_settings("cam-01")


def test_password_and_password_file_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="either password or password_file"):
        BrokerSettings(password="x", password_file=str(tmp_path / "p"))


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_flag_has_help_that_shows_its_default(command):
    # Prepare
    parser = subcommands()[command]

    # Execute
    flags = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
             and not isinstance(a, argparse._HelpAction)]
    text = parser.format_help()

    # Assert
    for action in flags:
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._CountAction))
        if not (switch or action.required):
            assert "default" in action.help, f"{command} {action.option_strings[0]} does not show its default"
        assert action.nargs != "?", f"{command} {action.option_strings[0]} shows an optional placeholder"
    assert "[RELEASE]" not in text and "[AMP]" not in text


@pytest.mark.parametrize("argv, verbosity", [
    (["simulate", "--algorithm", "fedavg"], 0),
    (["-v", "simulate", "--algorithm", "fedavg"], 1),
    (["simulate", "--algorithm", "fedavg", "-v"], 1),
    (["simulate", "-vv"], 2),
    (["release", "list", "--run", "runs/r1", "-v"], 1),
])
def test_the_verbosity_flag_works_before_and_after_the_command(argv, verbosity):
    assert build_parser().parse_args(argv).verbose == verbosity

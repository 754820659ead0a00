"""The wheel as users install it: built from the checkout, installed into fresh virtual
environments (the base install and `edgepfl[lite]`) from a wheelhouse of its dependencies, never
the editable checkout where every extra is importable.

Every command run without its extra ends in one line naming what it needs and how to install it
(exit 2, no traceback), and the wheel carries the license text and its SPDX expression.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.config import load_toml

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
"""sha256 of the Apache License 2.0 text as apache.org publishes it (LICENSE-2.0.txt)."""
PIP_TIMEOUT = 600
COMMAND_TIMEOUT = 60


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT, **kwargs)


def _checked(argv: list[str], what: str) -> subprocess.CompletedProcess:
    result = _run(argv)
    if result.returncode != 0:
        pytest.fail(f"{what} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def _source_copy(target: Path) -> Path:
    """The files the wheel is built from (the packages pyproject.toml includes, the readme and
    the license files), copied so that building writes nothing into the checkout."""
    project = load_toml(str(ROOT / "pyproject.toml"))
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    names = ["pyproject.toml", project["project"]["readme"], *project["project"].get("license-files", [])]
    target.mkdir()
    for name in names:
        shutil.copy2(ROOT / name, target / name)
    for path in ROOT.iterdir():
        if path.is_dir() and (path / "__init__.py").exists() and any(fnmatch(path.name, p) for p in patterns):
            shutil.copytree(path, target / path.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def _build_isolation() -> list[str]:
    """Build with this environment's setuptools when it is recent enough for pyproject.toml
    (no download), else in pip's isolated build environment."""
    try:
        import setuptools
    except ImportError:
        return []
    major = int(setuptools.__version__.split(".")[0])
    return ["--no-build-isolation"] if major >= 77 else []


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel built from the checkout, pip's build log)."""
    work = tmp_path_factory.mktemp("wheel")
    source = _source_copy(work / "source")
    result = _checked([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", *_build_isolation(),
                       str(source), "-w", str(work / "dist")], "building the wheel")
    (wheel,) = (work / "dist").glob("edgepfl-*.whl")
    return wheel, result.stdout + result.stderr


@pytest.fixture(scope="module")
def installs(built, tmp_path_factory) -> dict[str, Path]:
    """The `bin` folders of two fresh environments: the base install and `edgepfl[lite]`, their
    dependencies installed from a wheelhouse filled once with what the wheel's metadata names."""
    wheel, _ = built
    work = tmp_path_factory.mktemp("installs")
    wheelhouse = work / "wheelhouse"
    _checked([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d", str(wheelhouse),
              f"{wheel}[lite]"], "filling the wheelhouse")
    bins = {}
    for name, requirement in (("base", str(wheel)), ("lite", f"{wheel}[lite]")):
        venv = work / name
        _checked([sys.executable, "-m", "venv", "--without-pip", str(venv)], f"creating the {name} venv")
        _checked([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                  "--no-index", "--find-links", str(wheelhouse), requirement], f"installing {requirement}")
        bins[name] = venv / "bin"
    return bins


TRAIN, BROKER = '"edgepfl[train]"', '"edgepfl[broker]"'
DEVICE = ["--client-id", "dev000", "--index", "0"]
CASES = [
    ("base", ["simulate", "--rounds", "1"], ["PyTorch", TRAIN]),
    ("base", ["coordinator"], ["PyTorch", TRAIN]),
    ("base", ["export", "--run", "runs/x", "--out", "body.onnx"], ["PyTorch", TRAIN]),
    ("base", ["client", *DEVICE], ["--dataset digits", "scikit-learn", TRAIN, "--data"]),
    ("base", ["lite-client", *DEVICE, "--dataset", "digits"], ["scikit-learn", "pip install scikit-learn", "--data"]),
    ("base", ["broker"], ["amqtt", BROKER]),
    ("base", ["secagg-keys", "--devices", "dev000", "--out", "keys"], ["cryptography", '"edgepfl[secagg]"']),
    ("base", ["lite-client", "--client-id", "dev000", "--data", "own.npz"], ["ONNX Runtime", '"edgepfl[lite]"']),
    ("lite", ["simulate", "--rounds", "1"], ["PyTorch", TRAIN]),
    ("lite", ["coordinator"], ["PyTorch", TRAIN]),
    ("lite", ["export", "--run", "runs/x", "--out", "body.onnx"], ["PyTorch", TRAIN]),
    ("lite", ["broker"], ["amqtt", BROKER]),
    ("lite", ["lite-client", *DEVICE, "--dataset", "digits"], ["scikit-learn", "pip install scikit-learn", "--data"]),
    ("lite", ["client", "--client-id", "dev000", "--data", "own.npz"], ["PyTorch", TRAIN]),
]


@pytest.mark.parametrize(("install", "argv", "named"), CASES, ids=[f"{c[0]}-{c[1][0]}-{c[1][-1]}" for c in CASES])
def test_a_command_without_its_extra_ends_in_one_line(installs, tmp_path, install, argv, named):
    # Prepare: a device's own data, for the commands given --data; nothing that reaches the checkout
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "own.npz", x=rng.random((40, 8), dtype=np.float32), y=np.arange(40) % 4)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"

    # Execute
    result = subprocess.run([str(installs[install] / "edgepfl"), *argv], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=COMMAND_TIMEOUT)

    # Assert: exit 2 and one line on stderr that names the command, what it needs and the fix
    assert "Traceback" not in result.stderr
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"edgepfl {argv[0]} "), lines[0]
    for text in named:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("install", ["base", "lite"])
def test_every_install_lists_the_commands(installs, tmp_path, install):
    result = subprocess.run([str(installs[install] / "edgepfl"), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=COMMAND_TIMEOUT)

    assert result.returncode == 0, result.stderr
    assert "simulate" in result.stdout and "lite-client" in result.stdout


def test_the_wheel_ships_the_apache_license_as_an_spdx_expression(built):
    wheel, log = built
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_name).decode().split("\n\n", 1)[0].splitlines()
        license_names = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert len(license_names) == 1, names
        shipped = archive.read(license_names[0])

    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    assert not [line for line in metadata if line.startswith("License: ")]  # the deprecated free-text field
    assert hashlib.sha256(shipped).hexdigest() == APACHE_2_SHA256
    assert shipped == (ROOT / "LICENSE").read_bytes()
    assert not [line for line in log.splitlines() if "Warning" in line and "deprecated" in line]

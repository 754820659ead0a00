"""Which extra installs each optional module, and the one line a command ends with when it lacks one.

The base install (numpy, msgpack, paho-mqtt) is what every device needs; training, the built-in
datasets, ONNX and the embedded broker come with extras (`pyproject.toml`). A command imports
them only once its arguments are checked, so the `edgepfl` command turns the ModuleNotFoundError
of such an import into one line naming the package and the extra to install. Only a module of
`OPTIONAL_MODULES` that is really absent is reported so: an installed package that fails to
import a part of its own, or a module this table does not know, is a broken install or a bug
and keeps its traceback.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class OptionalModule:
    """A module outside the base install: what users call it, its pip name and the extra that installs it."""

    name: str
    dist: str
    extra: str


OPTIONAL_MODULES: dict[str, OptionalModule] = {
    "torch": OptionalModule("PyTorch", "torch", "train"),
    "torchvision": OptionalModule("torchvision", "torchvision", "train"),
    "sklearn": OptionalModule("scikit-learn", "scikit-learn", "train"),
    "scipy": OptionalModule("SciPy", "scipy", "train"),
    "matplotlib": OptionalModule("matplotlib", "matplotlib", "train"),
    "tqdm": OptionalModule("tqdm", "tqdm", "train"),
    "threadpoolctl": OptionalModule("threadpoolctl", "threadpoolctl", "train"),
    "PIL": OptionalModule("Pillow", "pillow", "train"),
    "onnxruntime": OptionalModule("ONNX Runtime", "onnxruntime", "lite"),
    "onnx": OptionalModule("ONNX", "onnx", "lite"),
    "amqtt": OptionalModule("amqtt", "amqtt", "broker"),
    "cryptography": OptionalModule("cryptography", "cryptography", "secagg"),
    "prometheus_client": OptionalModule("prometheus-client", "prometheus-client", "observe"),
    "tensorboard": OptionalModule("TensorBoard", "tensorboard", "observe"),
    "mlflow": OptionalModule("MLflow", "mlflow-skinny", "observe"),
}
"""Top-level import name -> the optional module it belongs to."""

DEVICE_EXTRAS = {"client": "train", "lite-client": "lite"}
"""The extra each device command is installed with: a device is told to install another extra
for its data only when that is its own (a weak device is not sent to install PyTorch)."""


class MissingExtra(Exception):
    """A command needs an optional module that is not installed; the message is the line to print."""


def absent_module(exc: ModuleNotFoundError) -> OptionalModule | None:
    """The optional module `exc` says is missing, if it is one and really is not installed;
    None for anything else (a bug, or an installed package missing a part of its own)."""
    top = (exc.name or "").partition(".")[0]
    module = OPTIONAL_MODULES.get(top)
    if module is None:
        return None
    try:
        installed = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):  # a half-imported package: not a missing one
        return None
    return None if installed else module


def missing_extra(exc: ModuleNotFoundError, command: str) -> MissingExtra | None:
    """`edgepfl simulate needs PyTorch: pip install "edgepfl[train]"`, or None when `exc` is not
    about a missing optional module."""
    module = absent_module(exc)
    if module is None:
        return None
    return MissingExtra(f'edgepfl {command} needs {module.name}: pip install "edgepfl[{module.extra}]"')


def missing_for_data(exc: ModuleNotFoundError, command: str, dataset: str | None) -> MissingExtra | None:
    """The line for a module a device needs to read its data: the built-in `dataset` (then
    `--data` is the other way) or, `dataset` None, its own `--data`. The fix is the device's own
    extra where that installs the module, else the package alone."""
    module = absent_module(exc)
    if module is None:
        return None
    own = DEVICE_EXTRAS.get(command)
    fix = f'pip install "edgepfl[{own}]"' if module.extra == own else f"pip install {module.dist}"
    if dataset is None:
        return MissingExtra(f"edgepfl {command} --data needs {module.name} to read this data: {fix}")
    return MissingExtra(f"edgepfl {command} --dataset {dataset} needs {module.name}: {fix}, or give the device's "
                        "own data with --data")

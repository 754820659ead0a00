"""Model factories: `factory(task) -> nn.Module`, named by a built-in name, an import path
`package.module:factory`, or an entry point of group `edgepfl.models`.

A worker process, a device and the coordinator each resolve the same name to the same factory,
so a user's model needs no registration at run time: only an importable module (or an
installed package that declares the entry point).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..data.task import TaskSpec
from .cnn import cnn1d, cnn8, cnn8_wide, cnn28, cnn32, cnn_adaptive, mlp
from .parted import ModelError, PartedNet
from .torchvision_models import mobilenet_v3_small_body, resnet18_body

ENTRY_POINT_GROUP = "edgepfl.models"

ModelFactory = Callable[[TaskSpec], nn.Module]
ModelSpec = str | ModelFactory
"""A built-in name, `auto`, an import path, an entry-point name, or a factory."""

_SQUARE_DEFAULTS = {8: "cnn8", 28: "cnn28", 32: "cnn32"}


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in network: a body for the task's inputs and a linear head on its features.

    `kinds` are the task kinds it takes and `sizes` the square image sizes (None: any).
    """

    name: str
    make: Callable[[TaskSpec], tuple[nn.Module, int]]
    kinds: tuple[str, ...] = ("image",)
    sizes: tuple[int, ...] | None = None

    def body(self, task: TaskSpec) -> tuple[nn.Module, int]:
        """(body, feature_dim) for `task`; ModelError if the model does not take its inputs."""
        if task.kind not in self.kinds:
            raise ModelError(f"model {self.name!r} takes {' or '.join(self.kinds)} tasks, not the {task.kind} task "
                             f"{task.name!r}; use model 'auto' or one for {task.kind} inputs")
        shape = task.input_shape
        if self.sizes is not None and (shape[1] != shape[2] or shape[1] not in self.sizes):
            allowed = ", ".join(f"{s}x{s}" for s in self.sizes)
            size = "x".join(str(s) for s in task.input_shape[1:])
            raise ModelError(f"model {self.name!r} takes images of size {allowed}, not {size}; "
                             f"cnn_adaptive takes any size")
        return self.make(task)

    def __call__(self, task: TaskSpec) -> PartedNet:
        body, feature_dim = self.body(task)
        return PartedNet(body, nn.Linear(feature_dim, task.num_classes), feature_dim)


BUILTINS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel("cnn8", lambda t: cnn8(t.channels), sizes=(8,)),
        BuiltinModel("cnn8_wide", lambda t: cnn8_wide(t.channels), sizes=(8,)),
        BuiltinModel("cnn28", lambda t: cnn28(t.channels), sizes=(28,)),
        BuiltinModel("cnn32", lambda t: cnn32(t.channels), sizes=(32,)),
        BuiltinModel("resnet18", lambda t: resnet18_body(t.channels)),
        BuiltinModel("mobilenet_v3_small", lambda t: mobilenet_v3_small_body(t.channels, max(t.input_shape[1:]))),
        BuiltinModel("cnn_adaptive", lambda t: cnn_adaptive(t.channels)),
        BuiltinModel("cnn1d", lambda t: cnn1d(t.channels), kinds=("signal",)),
        BuiltinModel("mlp", lambda t: mlp(math.prod(t.input_shape)), kinds=("features", "signal", "image")),
    )
}

MODEL_NAMES: tuple[str, ...] = tuple(BUILTINS)


def default_model_for(task: TaskSpec) -> str:
    """The built-in model `auto` stands for: cnn8, cnn28 or cnn32 for square images of those
    sizes, cnn_adaptive for other images, cnn1d for signals, mlp for feature vectors."""
    if task.kind == "image":
        _, height, width = task.input_shape
        return _SQUARE_DEFAULTS.get(height, "cnn_adaptive") if height == width else "cnn_adaptive"
    return "cnn1d" if task.kind == "signal" else "mlp"


def model_name(spec: ModelSpec) -> str:
    """The name a spec goes by in settings, reports and exported metadata: the spec string
    itself, or a factory's import path `module:qualname`."""
    if isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', type(spec).__name__)}"


def describe(spec: ModelSpec) -> str:
    """A model spec as messages name it."""
    if isinstance(spec, str):
        return repr(spec)
    return getattr(spec, "__qualname__", type(spec).__name__)


def resolve_factory(spec: ModelSpec, task: TaskSpec | None = None) -> ModelFactory:
    """The factory `spec` names: a callable as it is; a built-in name; `auto` (needs `task`);
    `package.module:attr` imported; otherwise an entry point of group `edgepfl.models`.

    Raises ModelError naming the spec and why it does not resolve.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ModelError(f"model spec must be a name, an import path or a factory, got {spec!r}")
    if spec == "auto":
        if task is None:
            raise ModelError("model 'auto' is chosen from the task: pass the task (default_model_for(task))")
        return BUILTINS[default_model_for(task)]
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" in spec:
        return _import_factory(spec)
    return _entry_point_factory(spec)


def _import_factory(spec: str) -> ModelFactory:
    module_name, _, attr = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except Exception as exc:  # an import error or any error the module raises while importing
        raise ModelError(f"model {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
                         f"it must be importable on the coordinator and on every trainer device") from exc
    for name in attr.split("."):
        if not hasattr(target, name):
            raise ModelError(f"model {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, name)
    if not callable(target):
        raise ModelError(f"model {spec!r}: {attr!r} is a {type(target).__name__}, not a factory(task) -> nn.Module")
    return target


def _entry_point_factory(spec: str) -> ModelFactory:
    points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=spec)
    if not points:
        raise ModelError(f"unknown model {spec!r}: not a built-in ({', '.join(MODEL_NAMES)}), not an import path "
                         f"'package.module:factory', and no installed package declares it in entry-point group "
                         f"{ENTRY_POINT_GROUP!r}")
    point = next(iter(points))
    try:
        factory = point.load()
    except Exception as exc:  # the entry point's own import
        raise ModelError(f"model {spec!r}: entry point {point.value!r} of group {ENTRY_POINT_GROUP!r} does not load "
                         f"({type(exc).__name__}: {exc})") from exc
    if not callable(factory):
        raise ModelError(f"model {spec!r}: entry point {point.value!r} is not a factory(task) -> nn.Module")
    return factory

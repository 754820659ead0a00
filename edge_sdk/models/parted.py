"""A model told apart into its feature extractor (`body`) and classifier (`head`).

Every algorithm works on named parts: `state_dict` keys start with the part's name. A user's
module is used as it is when it already has `body` and `head` children; any other module
(torchvision, timm-style, an `nn.Sequential`) declares its split once with `split(model,
head="fc")`. The feature dimension is found by a dry forward pass, so nothing has to be stated
twice.
"""

from __future__ import annotations

import torch
from torch import nn

from ..data.task import TaskSpec


class ModelError(ValueError):
    """A model that edgepfl cannot use as it is, with the reason and the fix in the message."""


class PartedNet(nn.Module):
    """A classifier made of named parts: `body` (features) then `head` (classifier).

    The attribute names are the part names that prefix the `state_dict` keys (`body.*`, `head.*`).
    `feature_dim` is D, the width of the body's output [B, D] (None until known: `split` leaves it
    to `build_model`, which measures it).
    """

    def __init__(self, body: nn.Module, head: nn.Module, feature_dim: int | None) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.feature_dim = feature_dim

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Map inputs [B, *input_shape] to features [B, feature_dim]."""
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map inputs [B, *input_shape] to logits [B, num_classes]."""
        return self.head(self.body(x))


def split(model: nn.Module, head: str) -> PartedNet:
    """Declare the split of `model` once: `head` is the dotted name of the submodule that maps
    features [B, D] to logits (`"fc"` for a torchvision ResNet, `"classifier.3"` or
    `"classifier"` for MobileNetV3, `"2"` for the third layer of an `nn.Sequential`).

    The body is `model` itself with that submodule replaced by `nn.Identity`, so the model's own
    `forward` still runs (pooling, flattening, ...) and ends at the features.
    """
    *path, leaf = head.split(".")
    parent = model
    for name in path:
        parent = _child(model, parent, name, head)
    classifier = _child(model, parent, leaf, head)
    if isinstance(parent, nn.Sequential) and leaf.isdigit():
        parent[int(leaf)] = nn.Identity()
    else:
        setattr(parent, leaf, nn.Identity())
    return PartedNet(model, classifier, None)


def _child(model: nn.Module, parent: nn.Module, name: str, head: str) -> nn.Module:
    children = dict(parent.named_children())
    if name not in children:
        known = ", ".join(n for n, _ in model.named_modules() if n) or "none"
        raise ModelError(f"split(head={head!r}): {type(model).__name__} has no submodule {head!r}; its submodules: "
                         f"{known[:400]}")
    return children[name]


def as_parted(module: nn.Module, where: str) -> PartedNet:
    """`module` as a `PartedNet`: itself, or its `body` and `head` children, checking that every
    parameter and buffer lies in one of them. `where` names the model in messages."""
    if isinstance(module, PartedNet):
        parted = module
    else:
        children = dict(module.named_children())
        if "body" not in children or "head" not in children:
            raise ModelError(f"model {where}: a {type(module).__name__} without `body` and `head` children; return "
                             f"edge_sdk.models.split(model, head='<name of the classifier>') from the factory")
        parted = PartedNet(children["body"], children["head"], getattr(module, "feature_dim", None))
        for key in module.state_dict():
            if key.split(".", 1)[0] not in ("body", "head"):
                raise ModelError(f"model {where}: {key!r} lies outside `body` and `head`; every parameter and "
                                 f"buffer must belong to one of the two parts")
    return parted


@torch.no_grad()
def feature_dim_of(body: nn.Module, task: TaskSpec, where: str) -> int:
    """D of a body's output [B, D] for the task's inputs, measured by a forward pass of zeros in
    evaluation mode (no running statistic moves, no random number is drawn)."""
    was_training = body.training
    body.eval()
    try:
        out = body(torch.zeros((2, *task.input_shape)))
    except Exception as exc:  # the user's network: any error means it does not take these inputs
        raise ModelError(f"model {where}: its body cannot take inputs {list(task.input_shape)} of task "
                         f"{task.name!r}: {exc}") from exc
    finally:
        body.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelError(f"model {where}: its body gives {shape} for a batch of 2, not features [B, D]; end the "
                         f"body with pooling and a flatten, or split the model at the layer after them")
    return int(out.shape[1])

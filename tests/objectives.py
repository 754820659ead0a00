"""The papers' loss terms written out independently of the algorithm modules, for the tests that
compare each algorithm's training objective (value and gradient) with its equation.

Everything here is plain tensor arithmetic, one anchor or one example at a time where that is
clearer; none of it calls an algorithm's or `edge_sdk.losses`' helper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

BATCH = 6
"""Examples in the tiny fixed batch."""


def tiny_batch(data, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `size` training examples of a device's data, as tensors (a fixed batch)."""
    return torch.from_numpy(data.train_x[:size]).clone(), torch.from_numpy(data.train_y[:size]).clone()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of -log softmax(logits)[y]."""
    log_probabilities = logits - logits.exp().sum(dim=1, keepdim=True).log()
    return -torch.stack([log_probabilities[i, int(y)] for i, y in enumerate(labels)]).mean()


def kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)), mean over the batch."""
    p, q = target.softmax(dim=1), logits.softmax(dim=1)
    return (p * (p.log() - q.log())).sum(dim=1).mean()


def supcon(features: torch.Tensor, labels: torch.Tensor, temperature: float, variant: str = "out") -> torch.Tensor:
    """Khosla et al.'s supervised contrastive loss over [batch, views, dim] features, one anchor at a
    time: `out` averages -log p(positive) over the positives (their Eq. 2), `in` takes -log of the
    average p (RepPer's Eq. 5). Anchors without a positive are left out of the mean."""
    batch, views, _ = features.shape
    z = [features[b, v] / features[b, v].norm() for b in range(batch) for v in range(views)]
    y = [int(labels[b]) for b in range(batch) for _ in range(views)]
    losses = []
    for j in range(len(z)):
        others = [a for a in range(len(z)) if a != j]
        positives = [p for p in others if y[p] == y[j]]
        if not positives:
            continue
        denominator = torch.stack([torch.exp(z[j] @ z[a] / temperature) for a in others]).sum()
        ratios = torch.stack([torch.exp(z[j] @ z[p] / temperature) / denominator for p in positives])
        losses.append(-ratios.log().mean() if variant == "out" else -ratios.mean().log())
    return torch.stack(losses).mean()


def value_and_gradients(loss: Callable[[], torch.Tensor], parameters: Mapping[str, torch.Tensor]
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its gradient with respect to each named parameter (zeros where it has none)."""
    value = loss()
    names = list(parameters)
    grads = torch.autograd.grad(value, [parameters[n] for n in names], allow_unused=True)
    return value.detach(), {n: torch.zeros_like(parameters[n]) if g is None else g
                            for n, g in zip(names, grads, strict=True)}


def assert_same_objective(loss: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor],
                          parameters: Mapping[str, torch.Tensor]) -> None:
    """`loss` and `reference` agree in value and in the gradient of every parameter."""
    value, grads = value_and_gradients(loss, parameters)
    expected_value, expected_grads = value_and_gradients(reference, parameters)
    torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in expected_grads.values()), "the reference has no gradient at all"
    for name in parameters:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=prefixed(f"gradient of {name}"))


def prefixed(prefix: str) -> Callable[[str], str]:
    """assert_close's message: `prefix` before torch's own."""
    return lambda message: f"{prefix}: {message}"


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before: dict[str, torch.Tensor], module: nn.Module, prefix: str) -> bool:
    """Whether any entry under `prefix` differs from `before`."""
    after = module.state_dict()
    return any(not torch.equal(before[k], after[k]) for k in before if k.startswith(prefix))

"""FediOS's training objective against Eq. (8)-(12) written out here, and what a local round may change.

alpha is 0.3 (not the default 0.5) and lambda 0.7, so that a fusion that ignores alpha or swaps
its weights, or a term that ignores lambda, shows; the projections are written as explicit zero
padding into R^D. By default L_re (Eq. 11) is the printed form, on the projected features, where it
is identically 0: the objective is the three cross-entropies. `l_re="extractors"` (the module's
Decision) takes it on the extractors' outputs before projection. Without the personal extractor
(Table 7's ablation, the module's other Decision) the objective is CE(head(phi_g)) alone, whatever
alpha, lambda and l_re say.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch

from builtin_tasks import digits_client
from edge_sdk.algorithms.base import Task
from coordinator.algorithms import hyperparameters
from edge_sdk.algorithms.fedios import FediOSDevice, Hyper, fedios_loss, orthogonality
from edge_sdk.settings import TrainSettings
from objectives import assert_same_objective, changed, cross_entropy, snapshot, tiny_batch, value_and_gradients

ALPHA, LAM, BLOCK, CAPACITY = 0.3, 0.7, 2, 3


@pytest.fixture(scope="module")
def data():
    return digits_client(1, num_clients=10, partition="dirichlet", seed=0)


def make_device(data, **hyper) -> FediOSDevice:
    settings = TrainSettings("cnn8", rounds=5, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    return FediOSDevice(Hyper(alpha=ALPHA, lam=LAM, **hyper), settings, data, "cpu", client_seed=11,
                        assignment={"block": BLOCK, "capacity": CAPACITY})


def embed(features: torch.Tensor, block: int, capacity: int) -> torch.Tensor:
    """P_block f: f in coordinates block*d..(block+1)*d-1 of R^((capacity+1) d), zeros elsewhere."""
    batch, d = features.shape
    out = torch.zeros(batch, (capacity + 1) * d, dtype=features.dtype)
    out[:, block * d:(block + 1) * d] = features
    return out


def reference_loss(model, x: torch.Tensor, y: torch.Tensor, l_re: str) -> torch.Tensor:
    """Eq. (12): CE(fused) + CE(generic) + CE(personal) + lambda * L_re, L_re = mean_k |a_k . b_k| on
    (a, b) = (phi_g, phi_p) as printed (`projected`) or (body(x), personal_body(x)) (`extractors`)."""
    generic, personal = model.body(x), model.personal_body(x)
    phi_g = embed(generic, 0, CAPACITY)
    phi_p = embed(personal, BLOCK, CAPACITY)
    phi_f = ALPHA * phi_g + (1 - ALPHA) * phi_p
    head = lambda phi: phi @ model.head.weight.T + model.head.bias  # noqa: E731 - the linear head, by hand
    pair = (phi_g, phi_p) if l_re == "projected" else (generic, personal)
    return (cross_entropy(head(phi_f), y) + cross_entropy(head(phi_g), y) + cross_entropy(head(phi_p), y)
            + LAM * reference_orthogonality(*pair))


def reference_cross_entropies(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. (10) alone: CE(fused) + CE(generic) + CE(personal), no L_re term at all."""
    phi_g = embed(model.body(x), 0, CAPACITY)
    phi_p = embed(model.personal_body(x), BLOCK, CAPACITY)
    head = lambda phi: phi @ model.head.weight.T + model.head.bias  # noqa: E731 - the linear head, by hand
    fused = ALPHA * phi_g + (1 - ALPHA) * phi_p
    return cast(torch.Tensor, sum(cross_entropy(head(phi), y) for phi in (fused, phi_g, phi_p)))


def reference_orthogonality(generic: torch.Tensor, personal: torch.Tensor) -> torch.Tensor:
    """Eq. (11) on the unprojected features: 1/|B| sum_k |sum_j generic[k, j] personal[k, j]|."""
    return torch.stack([cast(torch.Tensor, sum(generic[k, j] * personal[k, j] for j in range(generic.shape[1]))).abs()
                        for k in range(len(generic))]).mean()


def test_the_default_loss_is_eq_12_as_printed_which_is_the_three_cross_entropies(data) -> None:
    # Prepare: lambda 0.7 configured, l_re left at its default
    device = make_device(data)
    model = device.model.train()
    x, y = tiny_batch(data)
    loss = device.local_loss()
    parameters = dict(model.named_parameters())

    # Execute / Assert: Eq. (12) as printed, and that is Eq. (10) alone, in value and every gradient
    assert_same_objective(lambda: loss(x, y), lambda: reference_loss(model, x, y, "projected"), parameters)
    assert_same_objective(lambda: loss(x, y), lambda: reference_cross_entropies(model, x, y), parameters)


def test_the_printed_orthogonality_term_is_exactly_zero_with_no_gradient(data) -> None:
    # Prepare: the projected features of the device's two extractors (blocks 0 and BLOCK)
    model = make_device(data).model.train()
    x, _ = tiny_batch(data)
    parameters = dict(model.named_parameters())

    # Execute
    value, grads = value_and_gradients(
        lambda: orthogonality(model.generic_features(x), model.personal_features(x)), parameters)

    # Assert: Eq. (6) makes Eq. (11) vanish for every input, and with it every gradient
    assert float(value) == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_the_reconstruction_is_eq_12_on_the_extractors_outputs(data) -> None:
    # Prepare
    device = make_device(data, l_re="extractors")
    model = device.model.train()
    x, y = tiny_batch(data)
    loss = device.local_loss()

    # Execute / Assert: every parameter's gradient agrees
    assert_same_objective(lambda: loss(x, y), lambda: reference_loss(model, x, y, "extractors"),
                          dict(model.named_parameters()))


@pytest.mark.parametrize("value", ["printed", "before_projection", ""])
def test_an_unknown_l_re_form_is_refused_naming_the_key(value: str) -> None:
    # Execute / Assert
    with pytest.raises(ValueError, match="l_re"):
        hyperparameters("fedios", {"l_re": value})


def reference_generic_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The ablation's objective: CE(head(P^g body(x))), one term, no personal or fused copy, no L_re."""
    phi_g = embed(model.body(x), 0, CAPACITY)
    return cross_entropy(phi_g @ model.head.weight.T + model.head.bias, y)


def test_without_the_personal_extractor_the_loss_is_the_generic_cross_entropy_alone(data) -> None:
    # Prepare: alpha 0.3, lambda 0.7 and the reconstructed L_re as configured, which the ablation must not use
    device = make_device(data, personal_extractor=False, l_re="extractors")
    model = device.model.train()
    x, y = tiny_batch(data)
    parameters = dict(model.named_parameters())
    loss = device.local_loss()

    # Execute / Assert: value and every gradient (the head's bias included) are those of one CE
    assert not any(name.startswith("personal_body.") for name in parameters)
    assert_same_objective(lambda: loss(x, y), lambda: reference_generic_loss(model, x, y), parameters)


def test_without_the_personal_extractor_no_term_of_the_full_objective_remains(data) -> None:
    # Prepare: the full form's terms on this model, phi_p = 0: CE(head(0)) and a second generic CE
    device = make_device(data, personal_extractor=False)
    model = device.model.train()
    x, y = tiny_batch(data)

    # Execute
    with torch.no_grad():
        value = float(device.local_loss()(x, y))
        generic = float(reference_generic_loss(model, x, y))
        personal = float(cross_entropy(model.head(torch.zeros(len(x), model.head.in_features)), y))

    # Assert: the value is one generic CE, and the terms the Decision drops weigh enough to show
    assert value == pytest.approx(generic, rel=1e-6)
    assert personal > 1.0 and generic > 1.0


def test_the_orthogonality_loss_is_the_mean_absolute_inner_product_for_signed_features() -> None:
    # Prepare: signed features (the extractors' ReLU outputs are >= 0), so that |.| shows
    generator = torch.Generator().manual_seed(3)
    generic = torch.randn(5, 7, generator=generator, requires_grad=True)
    personal = torch.randn(5, 7, generator=generator, requires_grad=True)

    # Execute / Assert
    assert_same_objective(lambda: orthogonality(generic, personal),
                          lambda: reference_orthogonality(generic, personal),
                          {"generic": generic, "personal": personal})


def test_the_reconstructed_term_is_not_zero_and_trains_both_extractors_and_not_the_head(data) -> None:
    # Prepare: the loss without lambda's term, so that the difference is lambda * L_re alone
    device = make_device(data, l_re="extractors")
    model = device.model.train()
    x, y = tiny_batch(data)
    parameters = dict(model.named_parameters())

    # Execute
    with_term, grads = value_and_gradients(lambda: fedios_loss(model, LAM, "extractors")(x, y), parameters)
    without_term, grads_without = value_and_gradients(lambda: fedios_loss(model, 0.0, "extractors")(x, y), parameters)

    # Assert: the term weighs lambda * L_re > 0 and moves both extractors' gradients, not the head's
    with torch.no_grad():
        expected = LAM * reference_orthogonality(model.body(x), model.personal_body(x))
    assert float(expected) > 1e-3
    assert float(with_term - without_term) == pytest.approx(float(expected), rel=1e-4)
    for prefix in ("body.", "personal_body."):
        assert any(not torch.allclose(grads[n], grads_without[n]) for n in parameters if n.startswith(prefix)), prefix
    for name in ("head.weight", "head.bias"):
        torch.testing.assert_close(grads[name], grads_without[name])


def test_each_cross_entropy_term_moves_the_loss(data) -> None:
    # Prepare: the three CE terms separately (the fused one weighs alpha against 1 - alpha)
    device = make_device(data)
    model = device.model.train()
    x, y = tiny_batch(data)

    # Execute
    with torch.no_grad():
        total = float(fedios_loss(model, LAM, "projected")(x, y))
        phi_g, phi_p = embed(model.body(x), 0, CAPACITY), embed(model.personal_body(x), BLOCK, CAPACITY)
        generic = float(cross_entropy(model.head(phi_g), y))
        personal = float(cross_entropy(model.head(phi_p), y))
        fused = float(cross_entropy(model.head(ALPHA * phi_g + (1 - ALPHA) * phi_p), y))
        even = float(cross_entropy(model.head(0.5 * phi_g + 0.5 * phi_p), y))

    # Assert: the total is their sum, and the fused term is not the alpha = 0.5 one
    assert total == pytest.approx(generic + personal + fused, rel=1e-5)
    assert abs(fused - even) > 1e-4


def test_the_deployed_model_and_the_global_model_are_the_fused_and_the_generic_paths(data) -> None:
    # Prepare
    device = make_device(data)
    model = device.model.eval()
    x, _ = tiny_batch(data)

    # Execute
    with torch.no_grad():
        deployed, generic = model(x), model.global_logits(x)
        phi_g, phi_p = embed(model.body(x), 0, CAPACITY), embed(model.personal_body(x), BLOCK, CAPACITY)

    # Assert
    torch.testing.assert_close(deployed, model.head(ALPHA * phi_g + (1 - ALPHA) * phi_p))
    torch.testing.assert_close(generic, model.head(phi_g))


def test_a_local_round_changes_both_extractors_and_only_the_head_columns_of_its_blocks(data) -> None:
    # Prepare
    device = make_device(data)
    before = snapshot(device.model)
    d = device.model.body(torch.from_numpy(data.train_x[:2])).shape[1]

    # Execute
    device.fit(Task(1, {}, {}))

    # Assert: body, personal body and head learn; head columns of other clients' blocks do not
    after = device.model.state_dict()
    assert changed(before, device.model, "body.") and changed(before, device.model, "personal_body.")
    columns = after["head.weight"] != before["head.weight"]
    own = torch.zeros_like(columns)
    own[:, :d] = True
    own[:, BLOCK * d:(BLOCK + 1) * d] = True
    assert columns[own].any()
    assert not columns[~own].any()

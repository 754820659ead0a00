"""Personal heads on frozen features: linear SVM, logistic regression, MLP, nearest class mean.

A weak device fits one of these on the features its released representation gives for its own
training split, then composes body and head into one ONNX model (`compose.py`). Everything is
numpy: no scikit-learn, scipy or torch, which keeps the `lite` install small. RepPer's trainer
devices fit their `svm`, `lr` and `mlp_sklearn` heads here too.

Decisions:
- `svm`: one-vs-rest linear SVM, L2-regularized squared hinge loss with C = 1 (LinearSVC's
  objective; the bias is a constant feature, penalized like the weights, as in liblinear),
  solved by primal Newton (Chapelle 2007): each step solves the (d+1)x(d+1) system of the rows
  inside the margin, then an exact line search, until those rows stop changing (the exact
  minimum). Its features are divided by sigma * sqrt(d) rather than sigma (rows of norm ~1),
  as this head has always been fitted: fewer rows then sit near the margin (on 2,000 x 512
  features of a briefly trained cnn28 body: 6 Newton steps per class instead of about 20, and
  4 points more test accuracy than plainly standardized rows). Two classes give one score s,
  stored as the pair (0, s).
- `lr`: multinomial logistic regression, sum of log-losses + ||W||^2 / (2C) with C = 1, bias
  not penalized (scikit-learn's convention), by L-BFGS until max |gradient| of the mean loss
  <= 1e-5 (ten times tighter than scikit-learn's default).
- `mlp`: one hidden layer of 128 ReLU units, softmax output, mean cross-entropy +
  alpha ||W||^2 / (2 batch) with alpha 1e-3, Adam (lr 1e-3), minibatches of 200, Glorot-uniform
  initialization from `seed`; at most 300 epochs, stopped when the training loss has not
  improved by 1e-4 for 10 epochs (scikit-learn MLPClassifier's schedule).
- These three are fitted on standardized features (per-feature mean and standard deviation of
  the device's training split; constant features, such as dead ReLU units, are left out and
  get zero weights), and the standardization is then folded into the first layer
  (w' = w / sigma, b' = b - w' . mu), so the head takes raw features. A head scores only the
  classes of its training split (`classes`); its ONNX model spreads them over all C columns.
- `ncm` classifies by the Euclidean distance to class means of raw features: the global
  prototypes (pooled by the coordinator, weighted by counts) for every class they cover, the
  device's own means for the others, so a device also recognizes classes it has no data for.
- With a single class in the training split nothing discriminative can be fitted; the head is
  then an `ncm` head (constant when no global prototypes are known), logged as a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # onnx is imported when a head is written (`to_onnx`), after the fitting
    import onnx

log = logging.getLogger(__name__)

HEADS = ("svm", "lr", "mlp", "ncm")
MLP_HIDDEN = 128
C = 1.0
"""Inverse regularization strength of `svm` and `lr` (scikit-learn's default)."""
SVM_MAX_STEPS = 100
LR_TOLERANCE, LR_MAX_STEPS, LR_MEMORY = 1e-5, 2000, 50
MLP_ALPHA, MLP_LR, MLP_BATCH, MLP_MAX_EPOCHS, MLP_TOLERANCE, MLP_PATIENCE = 1e-3, 1e-3, 200, 300, 1e-4, 10
CONSTANT_FEATURE_STD = 1e-6
"""Feature dimensions whose standard deviation over the training split is at most this are
constant (dead units): heads give them zero weights (RepPer's torch heads too)."""

Prototypes = tuple[np.ndarray, np.ndarray]
"""(counts int64 [C], means float32 [C, d]): examples and mean feature per class."""

Layer = tuple[np.ndarray, np.ndarray]
"""(weights [in, out], bias [out]) of a dense layer."""


class Head(Protocol):
    """A fitted head: predicts labels in 0..C-1 from raw features and converts to ONNX."""

    kind: str
    num_classes: int

    def predict(self, features: np.ndarray) -> np.ndarray: ...

    def to_onnx(self, feature_dim: int) -> onnx.ModelProto: ...


def class_statistics(features: np.ndarray, labels: np.ndarray, num_classes: int) -> Prototypes:
    """Examples per class (int64 [C]) and mean feature per class (float32 [C, d]; zeros where a
    class has no example)."""
    features, labels = _check(features, labels, num_classes)
    counts = np.bincount(labels, minlength=num_classes).astype(np.int64)
    sums = np.zeros((num_classes, features.shape[1]), dtype=np.float64)
    np.add.at(sums, labels, features)
    means = np.divide(sums, counts[:, None], out=np.zeros_like(sums), where=counts[:, None] > 0)
    return counts, means.astype(np.float32)


@dataclass
class DenseHead:
    """Dense layers with ReLU between them over raw features; the last layer's columns score
    `classes` (class indices, in column order). Weights are float32, as in the ONNX model."""

    kind: str
    num_classes: int
    classes: np.ndarray  # int64 [K]
    layers: list[Layer]

    def scores(self, features: np.ndarray) -> np.ndarray:
        """Scores [N, K] of `classes` (float64)."""
        x = np.asarray(features, dtype=np.float64)
        for index, (weights, bias) in enumerate(self.layers):
            x = (np.maximum(x, 0.0) if index else x) @ weights + bias
        return x

    def predict(self, features: np.ndarray) -> np.ndarray:
        return self.classes[np.argmax(self.scores(features), axis=1)]

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """[N, C]: the softmax of the scores in the columns of `classes`, zeros elsewhere (what
        the ONNX model outputs)."""
        scores = self.scores(features)
        exp = np.exp(scores - scores.max(axis=1, keepdims=True))
        out = np.zeros((len(scores), self.num_classes), dtype=np.float32)
        out[:, self.classes] = exp / exp.sum(axis=1, keepdims=True)
        return out

    def to_onnx(self, feature_dim: int) -> onnx.ModelProto:
        if self.layers[0][0].shape[0] != feature_dim:
            raise ValueError(f"the head takes {self.layers[0][0].shape[0]} features, the body gives {feature_dim}")
        from .compose import dense_head_to_onnx

        return dense_head_to_onnx(self.layers, self.classes, self.num_classes)


@dataclass
class NcmHead:
    """Nearest class mean among the `present` classes (Euclidean)."""

    num_classes: int
    means: np.ndarray  # float32 [C, d]
    present: np.ndarray  # bool [C]
    kind: str = "ncm"

    def predict(self, features: np.ndarray) -> np.ndarray:
        classes = np.flatnonzero(self.present)
        x = np.asarray(features, dtype=np.float64)
        means = self.means[classes].astype(np.float64)
        distances = (x * x).sum(1, keepdims=True) - 2.0 * x @ means.T + (means * means).sum(1)
        return classes[np.argmin(distances, axis=1)].astype(np.int64)

    def to_onnx(self, feature_dim: int) -> onnx.ModelProto:
        if self.means.shape[1] != feature_dim:
            raise ValueError(f"class means have {self.means.shape[1]} features, the body gives {feature_dim}")
        from .compose import ncm_head_to_onnx

        return ncm_head_to_onnx(self.means, self.present)


def fit_head(
    kind: str,
    features: np.ndarray,
    labels: np.ndarray,
    *,
    num_classes: int,
    prototypes: Prototypes | None = None,
    seed: int = 0,
    hidden: int = MLP_HIDDEN,
) -> DenseHead | NcmHead:
    """Fit a head of `kind` (one of `HEADS`) on raw features [N, d] and labels in 0..C-1.

    `prototypes` (the coordinator's global class statistics) are used by `ncm`, `seed` and
    `hidden` (its width) by `mlp`; the other kinds ignore them."""
    if kind not in HEADS:
        raise ValueError(f"unknown head {kind!r}; known heads: {', '.join(HEADS)}")
    features, labels = _check(features, labels, num_classes)
    if kind == "ncm":
        return _fit_ncm(features, labels, num_classes, prototypes)
    classes = np.unique(labels)
    if classes.size < 2:
        log.warning("%s head needs two classes, the training split has %s: using class means", kind, classes.tolist())
        return _fit_ncm(features, labels, num_classes, prototypes)
    mean = features.mean(0, dtype=np.float64)
    scale = features.std(0, dtype=np.float64)
    live = scale > CONSTANT_FEATURE_STD
    if kind == "svm":
        scale = scale * np.sqrt(features.shape[1])  # rows of norm ~1 (see the module docstring)
    standardized = (features[:, live] - mean[live]) / scale[live]
    targets = np.searchsorted(classes, labels)  # the score column of each example
    fitters: dict[str, Callable[[], list[Layer]]] = {
        "svm": lambda: _fit_svm(standardized, targets, classes.size),
        "lr": lambda: _fit_lr(standardized, targets, classes.size),
        "mlp": lambda: _fit_mlp(standardized, targets, classes.size, hidden, seed),
    }
    (weights, bias), *rest = fitters[kind]()
    first = np.zeros((features.shape[1], weights.shape[1]))
    first[live] = weights / scale[live, None]  # fold the standardization into the first layer
    layers = [(first, bias - mean @ first), *rest]
    return DenseHead(kind, num_classes, classes,
                     [(w.astype(np.float32), b.astype(np.float32)) for w, b in layers])


# -- svm: squared hinge, one vs rest, primal Newton ---------------------------------------
def _fit_svm(x: np.ndarray, targets: np.ndarray, k: int) -> list[Layer]:
    """One weight column per class (one vs rest); with two classes one column, for class 1,
    next to a zero column for class 0."""
    z = np.hstack([x, np.ones((len(x), 1))])
    gram = z.T @ z
    signs = np.where(targets[:, None] == np.arange(k), 1.0, -1.0)
    columns = [1] if k == 2 else list(range(k))
    # Every row is inside the margin at w = 0, so the first Newton step is one shared ridge solve.
    start = np.linalg.solve(np.eye(len(gram)) + 2.0 * C * gram, 2.0 * C * z.T @ signs[:, columns])
    w = np.zeros((z.shape[1], k))
    for index, column in enumerate(columns):
        w[:, column] = _squared_hinge_newton(z, gram, signs[:, column], start[:, index])
    return [(w[:-1], w[-1])]


def _squared_hinge_newton(z: np.ndarray, gram: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmin_w ||w||^2 / 2 + C sum(max(0, 1 - y z.w)^2) from `w`: Newton steps on the rows
    inside the margin, each with an exact line search. The Hessian needs z^T z of those rows:
    updated by the rows that enter or leave, or recomputed from whichever side is smaller
    (`gram` is z^T z of all rows)."""
    margin = y * (z @ w)
    active = margin < 1.0
    covariance = _covariance(z, gram, active)
    for _ in range(SVM_MAX_STEPS):
        inside = z[active]
        gradient = w + 2.0 * C * inside.T @ (inside @ w - y[active])
        step = -np.linalg.solve(np.eye(len(w)) + 2.0 * C * covariance, gradient)
        if -(gradient @ step) <= 1e-12 * max(w @ w, 1.0):
            break  # the Newton decrement: w is the minimum up to rounding
        change = y * (z @ step)
        t = _line_minimum(w, step, 1.0 - margin, change)
        w, margin = w + t * step, margin + t * change
        new_active = margin < 1.0
        entered, left = new_active & ~active, active & ~new_active
        moved = entered.sum() + left.sum()
        if abs(t - 1.0) < 1e-9 and moved == 0:
            break  # w minimizes the quadratic of these rows, and they are still the rows inside
        if moved < min(new_active.sum(), len(z) - new_active.sum()):
            covariance += z[entered].T @ z[entered] - z[left].T @ z[left]
        else:
            covariance = _covariance(z, gram, new_active)
        active = new_active
    return w


def _covariance(z: np.ndarray, gram: np.ndarray, active: np.ndarray) -> np.ndarray:
    """z^T z of the `active` rows, computed from the smaller of the active and inactive rows."""
    if 2 * active.sum() <= len(z):
        return z[active].T @ z[active]
    return gram - z[~active].T @ z[~active]


def _line_minimum(w: np.ndarray, step: np.ndarray, slack: np.ndarray, change: np.ndarray) -> float:
    """argmin_t ||w + t step||^2 / 2 + C sum(max(0, slack - t change)^2): the root of its
    derivative, which is increasing and piecewise linear in t, by Newton's method kept inside a
    shrinking bracket."""
    along, length = w @ step, step @ step
    low, high, t = 0.0, np.inf, 1.0
    for _ in range(100):
        residual = slack - t * change
        on = residual > 0.0
        derivative = along + t * length - 2.0 * C * change[on] @ residual[on]
        low, high = (t, high) if derivative < 0.0 else (low, t)
        new = t - derivative / (length + 2.0 * C * change[on] @ change[on])
        if abs(new - t) <= 1e-12 * t:
            break
        t = new if low < new < high else (2.0 * t if np.isinf(high) else 0.5 * (low + high))
    return t


# -- lr: multinomial logistic regression, L-BFGS ------------------------------------------
def _fit_lr(x: np.ndarray, targets: np.ndarray, k: int) -> list[Layer]:
    n, d = x.shape
    z = np.hstack([x, np.ones((n, 1))])
    onehot = np.eye(k)[targets]
    penalized = np.ones(d + 1)
    penalized[-1] = 0.0  # the bias is not penalized

    def loss(flat: np.ndarray) -> tuple[float, np.ndarray]:
        """The mean log-loss plus ||W||^2 / (2 C n), and its gradient ([K, d+1], flattened)."""
        w = flat.reshape(k, d + 1)
        logits = z @ w.T
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        norm = exp.sum(axis=1, keepdims=True)
        value = (np.log(norm).sum() - (logits * onehot).sum()) + 0.5 / C * (penalized * w * w).sum()
        gradient = (exp / norm - onehot).T @ z + penalized * w / C
        return value / n, gradient.ravel() / n

    w = _lbfgs(loss, np.zeros(k * (d + 1))).reshape(k, d + 1)
    return [(w[:, :-1].T, w[:, -1])]


def _lbfgs(fun: Callable[[np.ndarray], tuple[float, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """Minimize a smooth convex `fun` (value, gradient) from `x` by L-BFGS with Armijo
    backtracking from the unit step, until max |gradient| <= LR_TOLERANCE."""
    value, gradient = fun(x)
    history: list[tuple[np.ndarray, np.ndarray, float]] = []
    for _ in range(LR_MAX_STEPS):
        if np.abs(gradient).max() <= LR_TOLERANCE:
            break
        direction = -gradient  # the two-loop recursion: direction = -H gradient
        alphas = []
        for s, g, rho in reversed(history):
            alphas.append(rho * s @ direction)
            direction = direction - alphas[-1] * g
        if history:
            s, g, _ = history[-1]
            direction = direction * (s @ g) / (g @ g)
        else:
            direction = direction / max(1.0, np.linalg.norm(direction))
        for (s, g, rho), alpha in zip(history, reversed(alphas), strict=True):
            direction = direction + s * (alpha - rho * g @ direction)
        slope = gradient @ direction
        t = 1.0
        while True:
            new_value, new_gradient = fun(x + t * direction)
            if new_value <= value + 1e-4 * t * slope or t < 1e-10:
                break
            t /= 2.0
        s, g = t * direction, new_gradient - gradient
        if s @ g > 1e-12:
            history = [*history[-(LR_MEMORY - 1):], (s, g, 1.0 / (s @ g))]
        x, value, gradient = x + s, new_value, new_gradient
    return x


# -- mlp: one hidden ReLU layer, softmax, Adam ----------------------------------------------
def _fit_mlp(x: np.ndarray, targets: np.ndarray, k: int, hidden: int, seed: int) -> list[Layer]:
    rng = np.random.default_rng(seed)
    x = x.astype(np.float32)
    n, d = x.shape
    params = []
    for fan_in, fan_out in ((d, hidden), (hidden, k)):
        bound = np.sqrt(6.0 / (fan_in + fan_out))  # Glorot uniform
        params += [rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32),
                   rng.uniform(-bound, bound, fan_out).astype(np.float32)]
    moments = [np.zeros_like(p) for p in params]
    squares = [np.zeros_like(p) for p in params]
    onehot = np.eye(k, dtype=np.float32)[targets]
    best, stale, steps = np.inf, 0, 0
    for _ in range(MLP_MAX_EPOCHS):
        total = 0.0
        order = rng.permutation(n)
        for start in range(0, n, MLP_BATCH):
            batch = order[start:start + MLP_BATCH]
            w1, b1, w2, b2 = params
            inputs = x[batch]
            hidden_out = np.maximum(inputs @ w1 + b1, 0.0)
            logits = hidden_out @ w2 + b2
            logits -= logits.max(axis=1, keepdims=True)
            log_norm = np.log(np.exp(logits).sum(axis=1))
            total += float((log_norm - logits[np.arange(len(batch)), targets[batch]]).sum())
            total += 0.5 * MLP_ALPHA * float((w1 * w1).sum() + (w2 * w2).sum())  # per batch, as scikit-learn
            delta = (np.exp(logits - log_norm[:, None]) - onehot[batch]) / len(batch)
            delta_hidden = (delta @ w2.T) * (hidden_out > 0)
            grads = [inputs.T @ delta_hidden + MLP_ALPHA * w1 / len(batch), delta_hidden.sum(0),
                     hidden_out.T @ delta + MLP_ALPHA * w2 / len(batch), delta.sum(0)]
            steps += 1
            rate = MLP_LR * (1.0 - 0.999 ** steps) ** 0.5 / (1.0 - 0.9 ** steps)
            for p, g, m, v in zip(params, grads, moments, squares, strict=True):
                m *= 0.9
                m += 0.1 * g
                v *= 0.999
                v += 0.001 * g * g
                p -= rate * m / (np.sqrt(v) + 1e-8)
        epoch_loss = total / n
        stale = stale + 1 if epoch_loss > best - MLP_TOLERANCE else 0
        best = min(best, epoch_loss)
        if stale > MLP_PATIENCE:
            break
    w1, b1, w2, b2 = params
    return [(w1, b1), (w2, b2)]


# -- ncm ------------------------------------------------------------------------------------
def _fit_ncm(features: np.ndarray, labels: np.ndarray, num_classes: int, prototypes: Prototypes | None) -> NcmHead:
    counts, means = class_statistics(features, labels, num_classes)
    present = counts > 0
    if prototypes is not None:
        global_counts, global_means = prototypes
        if global_means.shape != means.shape or global_counts.shape != counts.shape:
            raise ValueError(
                f"global prototypes {list(global_counts.shape)}/{list(global_means.shape)} do not match "
                f"{num_classes} classes of {means.shape[1]} features"
            )
        covered = np.asarray(global_counts) > 0
        means = np.where(covered[:, None], global_means, means).astype(np.float32)
        present = present | covered
    if not present.any():
        raise ValueError("ncm head: no class has local examples or global prototypes")
    return NcmHead(num_classes, means, present)


def _check(features: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    features = np.asarray(features, dtype=np.float32)
    labels = np.asarray(labels)
    if features.ndim != 2 or labels.shape != (features.shape[0],):
        raise ValueError(f"features [N, d] and labels [N] expected, "
                         f"got {list(features.shape)} and {list(labels.shape)}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must be in 0..{num_classes - 1}")
    return features, labels.astype(np.int64)

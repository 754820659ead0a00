"""The trainer client: run the algorithm the coordinator announces on local data.

The device learns the run's algorithm and settings from WELCOME, trains when a broadcast TRAIN
selects it, and evaluates its deployed model on EVALUATE. Its personal state is saved
atomically after every round and after an evaluation that changed it (DualFed recalibrates its
BatchNorm statistics), and reloaded after a restart, so a restarted device goes on as if it had
not stopped; it never goes upstream. The protocol itself (registration, status, repeated
requests) is `DeviceSession`'s. Under a lossy `downlink_codec` a TRAIN carries the change since
the previous one: the device adds it to the state it holds (`downlink.HeldState`), and asks for
the state by version (FETCH) when it does not hold the base.

Before the coordinator releases the body of an algorithm that keeps BatchNorm statistics
personal, it asks the trainers for the global body's statistics on their training data (an
EVALUATE of phase "statistics"): computed afresh on a copy of the global body, per-channel means
and variances of activations, like the class means weak devices share; never the device's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from . import algorithms, codecs
from .algorithms.base import DeviceAlgorithm, LossOverride, OptimizerFactory, Task
from .algorithms.torch_device import TorchDevice
from .attacks import corrupt
from .config import ConfigError, from_mapping
from .data import ClientData, device_seed
from .downlink import STATE, HeldState
from .models import (ModelSpec, Signature, build_model, first_mismatch, model_name, model_signature,
                     signature_from_plain, signature_to_plain)
from .params import floats_finite
from .privacy import PrivacySettings
from .privacy.disclosure import evaluation_figures, hello_figures
from .privacy.dpsgd import (ACCOUNTANT_KEY, DP_SGD_EPSILON, DpSgd, DpSgdAccountant, DpSgdRefused, check_dp_sgd, dp_sgd,
                            released_fit_metrics)
from .privacy.upstream import ROUND_CLIP, WITHIN_CLIP, UploadPrivacy, private_metrics, privatize, round_clip
from .protocol import STATISTICS, ArrayGroup, Envelope, Kind
from .secagg import stages as secagg_stages
from .secagg.session import SecureSession
from .settings import TrainSettings
from .session import RegistrationRefused
from .sparse_codec import Residuals
from .store import PersonalState, PersonalStore
from .training import gradient_clipping, mixed_precision

if TYPE_CHECKING:
    from .secagg.device import SecAggKeys

log = logging.getLogger(__name__)


class EdgeClient(SecureSession):
    """One trainer device. `run()` blocks until the run finishes or `stop` is set.

    `model` (a factory `factory(task) -> nn.Module`, or a spec) replaces the run's model on this
    device; `optimizer` (`fn(params, settings) -> Optimizer`) and `loss` (`fn(logits, targets)
    -> Tensor`) replace the local training step where the algorithm allows it (FedAvg family).
    `share_label_counts` says whether HELLO reports the training split's count per class (the
    coordinator's data report); off, the device says nothing of its labels. With `secagg_keys`
    (its identity key and the fleet's roster) the device takes part in rounds under secure
    aggregation, where it uploads only its masked vector (and, before a release, its masked
    BatchNorm statistics).
    """

    def __init__(
        self,
        client_id: str,
        data: ClientData,
        *,
        device: str = "auto",
        compute_lock: AbstractContextManager[Any] | None = None,
        attack: str | None = None,
        amp: bool = False,
        model: ModelSpec | None = None,
        optimizer: OptimizerFactory | None = None,
        loss: LossOverride | None = None,
        share_label_counts: bool = True,
        secagg_keys: SecAggKeys | None = None,
        **session: Any,
    ):
        super().__init__(client_id, secagg_keys=secagg_keys, examples=data.num_train, **session)
        self.data = data
        self.device = device
        self.store = PersonalStore(self.state_dir, client_id)
        self.attack = attack
        if attack is not None:
            log.warning("%s behaves as an adversary: its uploads are corrupted (%s)", client_id, attack)
        self._compute_lock = compute_lock or nullcontext()
        self.amp = amp
        self.model = model
        self._signatures: dict[ModelSpec, Signature] = {}
        self.optimizer = optimizer
        self.loss = loss
        self.algorithm: DeviceAlgorithm | None = None
        self.algorithm_id: str | None = None
        self.privacy: UploadPrivacy | None = None
        self.secure_run = False
        """The joined run is under secure aggregation: evaluation replies carry no count."""
        self.dp_sgd: DpSgd | None = None
        self.dp_sgd_delta = 0.0
        self.rounds_trained = 0
        self.residuals = Residuals()
        """Under upload_codec topk: what the device has not sent yet (error feedback, never uploaded)."""
        self.share_label_counts = share_label_counts
        self.held = HeldState()
        """The shared state of the last TRAIN, which a downlink change is added to (`edge_sdk.downlink`)."""

    def hello(self) -> tuple[dict[str, float], dict[str, Any]]:
        import torch

        metrics = hello_figures(self.data.num_train, self.data.num_test, private=self.run_private,
                                secure=self.run_secure)
        config: dict[str, Any] = {"device_type": "trainer", "accelerator": self.device, "amp": self.amp,
                                  "torch": torch.__version__, "task": self.data.task.name,
                                  "algorithms": list(algorithms.ALGORITHM_IDS), **self.secure_capability()}
        if self.share_label_counts and not (self.run_private or self.run_secure):  # the coordinator reports it
            config["label_counts"] = self.data.class_counts().tolist()
        if self.model is not None:  # the coordinator checks a model of the device's own
            config["model"] = {"name": model_name(self.model),
                               "signature": signature_to_plain(self._signature(self.model))}
        return metrics, config

    def _signature(self, spec: ModelSpec) -> Signature:
        """Names and shapes of the plain model `spec` builds for this device's task (built once
        per spec: HELLO is repeated on every reconnection). Built from a fixed seed: an
        unseeded build would draw from torch's global generator while another device of the same
        process initializes its network from a seed, and change that device's weights."""
        if spec not in self._signatures:
            self._signatures[spec] = model_signature(build_model(spec, self.data.task, seed=0))
        return self._signatures[spec]

    def _check_model(self, welcome: Envelope, settings: TrainSettings) -> None:
        """Refuse to join a run whose model differs from the one this device builds (another
        version of the model's package, say), naming the first parameter that differs."""
        if "model_signature" not in welcome.config:
            return
        expected = signature_from_plain(welcome.config["model_signature"])
        mismatch = first_mismatch(expected, self._signature(self.model if self.model is not None else settings.model))
        if mismatch is not None:
            raise RegistrationRefused(f"{self.client_id}: this device's model differs from the coordinator's: "
                                      f"{mismatch}")

    def handlers(self) -> dict[Kind, Callable[[Envelope], None]]:
        return {Kind.TRAIN: self._on_train, Kind.EVALUATE: self._on_evaluate, Kind.SECAGG: self._on_secagg}

    def join(self, welcome: Envelope) -> None:
        algorithm_id = welcome.config["algorithm"]
        algorithm_cls = algorithms.load(algorithm_id)
        hyper = from_mapping(algorithm_cls.Hyper, welcome.config.get("hyper", {}), where=f"algorithm.{algorithm_id}")
        settings = from_mapping(TrainSettings, welcome.config["settings"], where="settings")
        self._check_model(welcome, settings)
        seed = device_seed(settings.seed, self.client_id)
        data = self.data.for_run(settings.validation_fraction, seed)
        algorithm = algorithm_cls(hyper, settings, data, self.device, seed, welcome.config.get("assignment", {}),
                                  model=self.model, optimizer=self.optimizer, loss=self.loss)
        self.algorithm, self.algorithm_id = algorithm, algorithm_id
        privacy, self.privacy = UploadPrivacy.announced(welcome.config, settings.seed)
        self.secure_run = welcome.config.get(secagg_stages.SECURE) is True
        self.dp_sgd_delta = self._dp_sgd_delta(privacy, data.num_train) if privacy.dp_sgd else 0.0
        saved = self.store.restore(welcome.run_id, algorithm_id)
        personal, residual = Residuals.split(dict(saved.arrays) if saved is not None else {})
        self.residuals = Residuals(residual)
        history = {key: personal.pop(key) for key in (ACCOUNTANT_KEY,) if key in personal}
        self.dp_sgd = self._dp_sgd(privacy, algorithm, history, seed) if privacy.dp_sgd else None
        if saved is not None:
            algorithm.load_personal_state(personal)
            self.rounds_trained = saved.round
            log.info("%s: personal state of round %d restored", self.client_id, saved.round)

    def _dp_sgd_delta(self, privacy: PrivacySettings, examples: int) -> float:
        """This device's DP-SGD delta over its `examples` training examples; RegistrationRefused,
        naming dp_sgd_delta, when the run's is not below 1 / examples."""
        try:
            return privacy.dp_sgd_delta_for(examples)
        except ConfigError as exc:
            raise RegistrationRefused(f"{self.client_id}: {exc}") from None

    def _dp_sgd(self, privacy: PrivacySettings, algorithm: DeviceAlgorithm, history: ArrayGroup, seed: int) -> DpSgd:
        """This device's DP-SGD for the run, its accountant continued from the personal store;
        RegistrationRefused when the algorithm, model or loss has no per-example gradients."""
        try:
            if not isinstance(algorithm, TorchDevice):
                raise DpSgdRefused(f"--dp-sgd is refused for {algorithm.id}: it trains no PyTorch network")
            check_dp_sgd(type(algorithm), algorithm.model, own_loss=self.loss is not None)
        except DpSgdRefused as exc:
            raise RegistrationRefused(f"{self.client_id}: {exc}") from None
        return DpSgd.from_settings(privacy, DpSgdAccountant.from_arrays(history),
                                   seed if privacy.dp_reproducible_noise else None)

    def _epsilon(self) -> dict[str, float]:
        """Under DP-SGD, the device's record-level epsilon so far (a metric it may report)."""
        if self.dp_sgd is None:
            return {}
        return {DP_SGD_EPSILON: self.dp_sgd.accountant.epsilon(self.dp_sgd_delta)}

    def _algorithm(self) -> tuple[DeviceAlgorithm, str]:
        """The algorithm built at `join`, and its id; requests are only handled after it (`current`)."""
        if self.algorithm is None or self.algorithm_id is None:
            raise RuntimeError(f"{self.client_id}: a request arrived before the WELCOME")
        return self.algorithm, self.algorithm_id

    def _save(self, envelope: Envelope, round_: int, personal: ArrayGroup) -> None:
        """Save the personal state after `round_` of the run `envelope` belongs to (the joined run)."""
        _, algorithm_id = self._algorithm()
        if self.dp_sgd is not None:  # the accountant's history goes on after a restart
            personal = {**personal, **self.dp_sgd.accountant.to_arrays()}
        personal = {**personal, **self.residuals.to_arrays()}  # topk's error feedback, likewise
        self.store.save(PersonalState(self.client_id, envelope.run_id, algorithm_id, round_, personal))

    def _on_train(self, envelope: Envelope) -> None:
        if not self.current(envelope):  # (it registers again on a TRAIN of another run)
            if self.joined and envelope.run_id == self.run_id:
                self.held.receive(envelope)  # not selected: the held state follows every TRAIN of the run
            return
        if self.answered(envelope):
            return
        full = self.held.receive(envelope)
        if full is None:
            self._fetch_state(envelope)
        else:
            self._train(full)

    def _fetch_state(self, train: Envelope) -> None:
        """Ask for the full state of a TRAIN that carries a change from a state this device does
        not hold; the coordinator answers with the same TRAIN, in full, on this device's topic."""
        version = train.config["downlink"]["version"]
        log.info("%s: round %d's TRAIN changes a state this device lacks; asking for state %d in full",
                 self.client_id, train.round, version)
        self.send(Kind.FETCH, train.round, config={STATE: version, "in_reply_to": train.msg_id})

    def _train(self, envelope: Envelope) -> None:
        secure = envelope.config.get(secagg_stages.SECURE) is True
        if secure and self.secure is not None and self.secure.pending is not None and (
                self.secure.pending.request.msg_id == envelope.msg_id):
            return  # trained already; the masked update goes up once the neighbours' shares are here
        algorithm, _ = self._algorithm()
        task = Task(envelope.round, envelope.groups, envelope.config)
        before = algorithm.personal_state()
        clipping = gradient_clipping(algorithm.settings.grad_clip_norm)
        with self._compute_lock, mixed_precision(self.amp), clipping, dp_sgd(self.dp_sgd):
            result = algorithm.fit(task)
        personal = algorithm.personal_state()
        groups, metrics = result.groups, result.metrics
        if self.dp_sgd is not None:  # the measured loss is a figure of the records: it stays here
            metrics = released_fit_metrics(metrics, self._epsilon()[DP_SGD_EPSILON])
        if self.privacy is not None:  # clipped (and, local or distributed DP, noised); no figure of the data goes up
            rng = self.privacy.generator(self.client_id, envelope.round, "upload")
            clip = round_clip(envelope.config, self.privacy)
            groups, norm = privatize(groups, envelope.groups, self.privacy, rng, clip, envelope.config)
            metrics = {WITHIN_CLIP: float(norm <= clip)} if ROUND_CLIP in envelope.config else {}
        if not secure:  # the codec comes after clipping and noise; topk's residual is saved with the personal state
            groups = codecs.encode(codecs.UploadCodec.of(algorithm.settings), groups, envelope.groups,
                                   rng=codecs.rounding_generator(algorithm.settings.seed, envelope.round,
                                                                 self.client_id),
                                   residuals=self.residuals)
        if floats_finite(personal) and all(floats_finite(group) for group in result.groups.values()):
            self.rounds_trained = envelope.round
            self._save(envelope, envelope.round, personal)
        else:  # the update goes up all the same: the coordinator rejects and counts it, and stops waiting
            log.warning("%s: training diverged in round %d (non-finite parameters); personal state of round %d kept",
                        self.client_id, envelope.round, self.rounds_trained)
            algorithm.load_personal_state(before)
            if self.dp_sgd is not None:  # its noised steps were taken all the same
                self._save(envelope, self.rounds_trained, before)
        if secure:
            self._secure_upload(envelope, groups)
            return
        if self.attack is not None:
            rng = np.random.default_rng([sum(self.client_id.encode()), envelope.round])
            groups = corrupt(self.attack, groups, envelope.groups, rng)
        self.send(Kind.TRAIN_RES, envelope.round, request=envelope, groups=groups, metrics=metrics)

    def _secure_upload(self, request: Envelope, groups: dict[str, ArrayGroup]) -> None:
        """Under secure aggregation: the trained upload as a masked vector, sent once the
        neighbours' shares are here (now, or when they arrive)."""
        if self.secure is None:
            raise RegistrationRefused(f"{self.client_id}: a round under secure aggregation, and this device has no "
                                      "secure-aggregation keys")
        self.secure.vector(request, groups)
        self._send_masked()

    def _on_evaluate(self, envelope: Envelope) -> None:
        if not self.current(envelope) or self.answered(envelope):
            return
        algorithm, _ = self._algorithm()
        task = Task(envelope.round, envelope.groups, envelope.config)
        if envelope.config.get("phase") == STATISTICS:
            with self._compute_lock:
                statistics = algorithm.body_statistics(task)
            if envelope.config.get(secagg_stages.SECURE) is True:  # masked: the coordinator sees only the sum
                self._send_pool_share(envelope, statistics, {})
                return
            examples: dict[str, float] = {"num_examples": algorithm.data.num_train}
            self.send(Kind.EVAL_RES, envelope.round, request=envelope, groups={STATISTICS: statistics},
                      metrics=examples)
            return
        steps = self.dp_sgd.accountant.steps if self.dp_sgd is not None else 0
        with self._compute_lock, dp_sgd(self.dp_sgd):  # a head fitted at evaluation trains privately too
            before = algorithm.personal_state()
            metrics = {**algorithm.evaluate(task), **self._epsilon()}
            personal = algorithm.personal_state()
        trained = self.dp_sgd is not None and self.dp_sgd.accountant.steps != steps
        if (_changed(before, personal) or trained) and floats_finite(personal):
            # e.g. DualFed's recalibrated BatchNorm statistics: the next round trains from them, so a
            # restarted device must too, or a resumed run is not the run made at once
            self._save(envelope, self.rounds_trained, personal)
        if self.privacy is not None:
            metrics = private_metrics(metrics, self.privacy,
                                      self.privacy.generator(self.client_id, envelope.round, "evaluation"))
        metrics = evaluation_figures(metrics, envelope.config, secure=self.secure_run)
        self.send(Kind.EVAL_RES, envelope.round, request=envelope, metrics=metrics)


def _changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> bool:
    """Whether a personal state differs from an earlier copy (names, shapes or values)."""
    return before.keys() != after.keys() or any(not np.array_equal(before[k], after[k]) for k in after)

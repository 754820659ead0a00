"""The weak-device client: personalize a released representation with onnxruntime and a numpy head.

A lite device never trains the representation. It registers (HELLO), joins a run (WELCOME),
learns of the run's released representation from the retained RELEASE manifest, fetches the
ONNX bytes it does not have yet (FETCH -> ARTIFACT, verified against the manifest's sha256 and
cached under `<state_dir>/artifacts/<sha256>.onnx`), and on EVALUATE embeds its train and test
splits, fits its personal head (the global prototypes an EVALUATE may carry help the `ncm`
head), writes the
personalized model (body + head, one ONNX file; `<state_dir>/personalized-<device id>.onnx`
unless given, so devices may share a state folder) atomically and reports its test accuracy, with
its class means when it shares prototypes (under secure aggregation only masked, in the release
phase's secure pool: `SecureSession`). In a run with a validation split
(`validation_fraction`, announced in WELCOME) it fits on the rest of its training data and is
scored on the held-out share, as trainer devices are; its test split is not read. Nothing in its
import chain imports torch, scikit-learn or scipy.

A retained manifest may belong to another run, or arrive before WELCOME: the latest is kept
and used once the device has joined the run it names.

The device keeps its last good release (`deployment`): the personalized model is composed next
to `model_path` and replaces it only if it scores at least as well as the model deployed, or the
manifest says `rollback` (the operator's decision); otherwise the deployed model stays and the
EVAL_RES says why (`kept`). What it deploys is recorded in `<state_dir>/deployed-<device id>.json`
and said in its HELLO (`runs`), so a restarted device knows it. A release that fails
verification (never received intact, rejected by onnxruntime, or its feature extractor fails)
is never deployed: an EVALUATE of it is answered with the deployed model's accuracy and the
reason (nothing deployed: it is not answered).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from ..config import from_mapping
from ..data import ClientData, device_seed
from ..privacy.disclosure import evaluation_figures, hello_figures
from ..privacy.upstream import UploadPrivacy, private_metrics
from ..protocol import PROTOTYPES, Envelope, Kind, ProtocolError, Reason, ValidationError
from ..secagg import stages as secagg_stages
from ..secagg.session import SecureSession
from ..settings import TrainSettings
from ..store import write_atomic
from .deployment import Deployment, describe_release, kept_because, read_deployment, write_deployment
from .features import FeatureExtractor
from .heads import HEADS, Head, Prototypes, class_statistics, fit_head

if TYPE_CHECKING:
    from ..secagg.device import SecAggKeys

log = logging.getLogger(__name__)
release_log = logging.getLogger(f"{__name__}.releases")
"""One line per release the device takes or keeps: `edgepfl lite-client` shows it without -v."""


def show_releases() -> None:
    """Show the release lines at any log level (a device run on its own, as `edgepfl lite-client`)."""
    if not release_log.isEnabledFor(logging.INFO):
        release_log.setLevel(logging.INFO)


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Release:
    """A RELEASE manifest: which bytes make the run's representation. `version` None: not
    numbered (newer than anything deployed); `rollback`: the operator moves the fleet back to it."""

    run_id: str
    round: int
    sha256: str
    size: int
    metadata: dict[str, Any]
    version: int | None = None
    rollback: bool = False

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> Release:
        config = envelope.config
        sha, size = config.get("sha256"), config.get("size")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise ProtocolError(Reason.MALFORMED, f"release sha256 {sha!r} is not 64 lowercase hex digits")
        if not isinstance(size, int) or size < 1 or config.get("format") != "onnx":
            raise ProtocolError(Reason.MALFORMED, f"release of size {size!r} and format {config.get('format')!r}")
        metadata = config.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ProtocolError(Reason.MALFORMED, "release metadata is not a mapping")
        version, rollback = config.get("version"), config.get("rollback", False)
        if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
            raise ProtocolError(Reason.MALFORMED, f"release version {version!r} is not an int >= 1")
        if not isinstance(rollback, bool):
            raise ProtocolError(Reason.MALFORMED, f"release rollback {rollback!r} is not a bool")
        return cls(envelope.run_id, envelope.round, sha, size, metadata, version, rollback)

    def describe(self) -> str:
        """How logs name it: its version, when numbered, and its sha256 prefix."""
        return describe_release(self.sha256, self.version)


@dataclass(frozen=True)
class Evaluation:
    """The last evaluation: the head, its test predictions and the personalized model's path
    (`deployed` false: it scored lower than the deployed model, which stays at that path)."""

    round: int
    accuracy: float
    head: Head
    predictions: np.ndarray
    model_path: Path
    deployed: bool = True


class LiteClient(SecureSession):
    """One weak device. `run()` blocks until the run finishes or `stop` is set. With `secagg_keys`
    it takes part in runs under secure aggregation, where its prototypes go up only masked."""

    def __init__(
        self,
        client_id: str,
        data: ClientData,
        *,
        head: str = "svm",
        providers: str | list[str] = "auto",
        share_prototypes: bool = True,
        model_path: str | Path | None = None,
        seed: int = 0,
        max_fetches: int = 3,
        fetch_timeout: float = 60.0,
        secagg_keys: SecAggKeys | None = None,
        **session: Any,
    ):
        super().__init__(client_id, secagg_keys=secagg_keys, examples=data.num_train, **session)
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; known heads: {', '.join(HEADS)}")
        self.own_data = data
        self.data = data  # what the joined run fits and scores on (`ClientData.for_run`)
        self.head_kind = head
        self.providers = providers
        self.share_prototypes = share_prototypes
        default = self.state_dir / f"personalized-{client_id}.onnx"  # devices may share a state folder
        self.model_path = Path(model_path) if model_path is not None else default
        self.seed = seed
        self.max_fetches = max_fetches
        self.fetch_timeout = fetch_timeout
        self.release: Release | None = None
        self.prototypes: Prototypes | None = None
        self.privacy: UploadPrivacy | None = None
        self.secure_run = False
        """The joined run is under secure aggregation: prototypes go up only masked."""
        self.evaluation: Evaluation | None = None
        self._unjoined: Envelope | None = None  # the latest RELEASE of a run not joined (yet)
        self._body: bytes | None = None
        self._loaded: str | None = None  # sha256 of the representation in `_extractor`
        self._extractor: FeatureExtractor | None = None
        self._features: tuple[str, np.ndarray, np.ndarray] | None = None  # (sha256, train, test)
        self._waiting: Envelope | None = None  # an EVALUATE that arrived before the artifact
        self._fetches: Counter[str] = Counter()
        self._fetched_at: dict[str, float] = {}
        self._failed: dict[str, str] = {}  # sha256 -> why that release failed verification
        self.deployment_path = self.state_dir / f"deployed-{client_id}.json"
        self.deployed: Deployment | None = read_deployment(self.deployment_path, self.model_path)
        """What this device runs (its personalized model), kept across restarts."""

    @property
    def missing_model(self) -> str | None:
        """Why a finished run left this device without a personalized model (None when it has
        one, or while the run goes on): the command exits non-zero with it."""
        if not self.finished or self.evaluation is not None or self.deployed is not None:
            return None
        if self.release is None:
            return (f"run {self.run_id} finished without releasing a representation, so this weak device has no "
                    "model: run the coordinator with --release (or an algorithm that releases one, such as repper)")
        if self.release.sha256 in self._failed:
            return (f"the representation {self.release.sha256[:12]} released by run {self.run_id} failed "
                    f"verification ({self._failed[self.release.sha256]}): no personalized model was written")
        return (f"run {self.run_id} finished before this device was asked to evaluate the released representation "
                f"{self.release.sha256[:12]}: no personalized model was written")

    def run(self, stop: threading.Event | None = None) -> None:
        """The session's `run`; a run that ends without a model for this device is logged as an error."""
        super().run(stop)
        if self.missing_model is not None:
            log.error("%s: %s", self.client_id, self.missing_model)

    # -- the session's hooks ---------------------------------------------------------------
    def hello(self) -> tuple[dict[str, float], dict[str, Any]]:
        metrics = hello_figures(self.own_data.num_train, self.own_data.num_test, private=self.run_private,
                                secure=self.run_secure)
        config: dict[str, Any] = {"device_type": "lite", "heads": list(HEADS), "head": self.head_kind,
                                  "onnxruntime": ort.__version__, "task": self.own_data.task.name,
                                  **self.secure_capability()}
        if self.share_prototypes and not (self.run_private or self.run_secure):  # as the prototypes: shared or kept
            config["label_counts"] = self.own_data.class_counts().tolist()
        # a release service does not ask again for what a device runs; under DP that says whether it
        # kept an older model, a comparison of accuracies on its data
        if self.deployed is not None and not self.run_private:
            config["runs"] = self.deployed.sha256
        return metrics, config

    def handlers(self) -> dict[Kind, Callable[[Envelope], None]]:
        return {Kind.RELEASE: self._on_release, Kind.ARTIFACT: self._on_artifact, Kind.EVALUATE: self._on_evaluate,
                Kind.SECAGG: self._on_secagg}

    def join(self, welcome: Envelope) -> None:
        # the session records the run after `join` returns; a FETCH sent from here needs it now
        self.run_id = welcome.run_id
        settings = from_mapping(TrainSettings, welcome.config.get("settings", {}), where="settings")
        self.data = self.own_data.for_run(settings.validation_fraction, device_seed(settings.seed, self.client_id))
        _, self.privacy = UploadPrivacy.announced(welcome.config, settings.seed)
        self.secure_run = welcome.config.get(secagg_stages.SECURE) is True
        self.release, self.prototypes, self._waiting, self._features = None, None, None, None
        early, self._unjoined = self._unjoined, None
        if early is not None and early.run_id == welcome.run_id:
            self._activate(Release.from_envelope(early))

    # -- the released representation -------------------------------------------------------
    def artifact_path(self, sha256: str) -> Path:
        return self.state_dir / "artifacts" / f"{sha256}.onnx"

    @property
    def ready(self) -> bool:
        """True when the joined run's released representation is loaded (and passed verification)."""
        return self.release is not None and self._loaded == self.release.sha256

    def _on_release(self, envelope: Envelope) -> None:
        release = Release.from_envelope(envelope)
        if not self.joined or envelope.run_id != self.run_id:
            self._unjoined = envelope
            return
        self._activate(release)

    def _activate(self, release: Release) -> None:
        if self.release == release and self.ready:
            return  # the retained manifest again (after a reconnection)
        if self.release is not None and self.release.sha256 != release.sha256:
            self.prototypes = None  # the class prototypes pooled on another representation's features
        self.release = release
        log.info("%s: release %s of round %d (%d bytes%s)", self.client_id, release.describe(), release.round,
                 release.size, ", a rollback" if release.rollback else "")
        if release.sha256 in self._failed or self._load_cached(release):  # failed before: it would again
            self._answer_waiting()
        else:
            self._fetch(release)

    def _load_cached(self, release: Release) -> bool:
        """Load the cached artifact: True if one was there intact (loaded, or failed verification)."""
        path = self.artifact_path(release.sha256)
        if not path.exists():
            return False
        body = path.read_bytes()
        if hashlib.sha256(body).hexdigest() != release.sha256:
            log.warning("%s: cached artifact %s is damaged; fetching it again", self.client_id, path)
            path.unlink()
            return False
        self._load(body, release)
        return True

    def _load(self, body: bytes, release: Release) -> bool:
        """Load verified bytes with onnxruntime; False (and the release failed) when it refuses them."""
        try:
            self._extractor = FeatureExtractor(body, self.providers)
        except ValueError as exc:  # RepresentationError: not a model, or not a representation
            self._fail(release, str(exc))
            return False
        self._body, self._loaded = body, release.sha256
        return True

    def _fail(self, release: Release, reason: str) -> None:
        """`release` failed verification: say so once, never deploy it, drop it if loaded."""
        if release.sha256 in self._failed:
            return
        self._failed[release.sha256] = reason
        if self._loaded == release.sha256:
            self._extractor = self._body = self._loaded = self._features = None
        keeps = f"keeps release {self.deployed.describe()}" if self.deployed is not None else "nothing is deployed"
        log.warning("%s: release %s failed verification: %s; %s", self.client_id, release.describe(), reason, keeps)

    def _fetch(self, release: Release, *, again: bool = False) -> None:
        """Ask for the artifact, unless a request is in flight (younger than `fetch_timeout`) and
        `again` (the last answer was damaged) is not set."""
        sha = release.sha256
        if not again and time.monotonic() - self._fetched_at.get(sha, float("-inf")) < self.fetch_timeout:
            return
        if self._fetches[sha] >= self.max_fetches:
            self._fail(release, f"artifact not received intact after {self._fetches[sha]} requests")
            self._answer_waiting()
            return
        self._fetches[sha] += 1
        self._fetched_at[sha] = time.monotonic()
        self.send(Kind.FETCH, release.round, config={"sha256": sha})

    def _on_artifact(self, envelope: Envelope) -> None:
        release = self.release
        sha = envelope.config.get("sha256")
        if release is None or envelope.run_id != self.run_id or sha != release.sha256:
            raise ValidationError(Reason.UNKNOWN_ARTIFACT, f"artifact {sha!r} is not the joined run's release")
        if self.ready or sha in self._failed:
            return  # a second answer to a repeated FETCH, or bytes that failed verification already
        data = envelope.groups.get("artifact", {}).get("onnx")
        if data is None or data.dtype != np.uint8 or data.ndim != 1:
            raise ProtocolError(Reason.MALFORMED, "an artifact carries group 'artifact' with a uint8 vector 'onnx'")
        body = data.tobytes()
        digest = hashlib.sha256(body).hexdigest()
        if digest != release.sha256 or len(body) != release.size:
            self.channel.reject(Reason.CHUNK_CHECKSUM, f"artifact {release.sha256[:12]}: {len(body)} bytes "
                                f"hashing to {digest[:12]}, the manifest says {release.size}")
            self._fetch(release, again=True)
            return
        if self._load(body, release):
            write_atomic(self.artifact_path(release.sha256), body)
            log.info("%s: artifact %s cached", self.client_id, release.sha256[:12])
        self._answer_waiting()

    # -- global prototypes (pooled by the coordinator, sent with the final EVALUATE) ---------
    def _parse_prototypes(self, envelope: Envelope) -> Prototypes:
        group = envelope.groups.get(PROTOTYPES, {})
        counts, means = group.get("counts"), group.get("means")
        classes = self.data.task.num_classes
        if counts is None or means is None:
            raise ProtocolError(Reason.MALFORMED, "prototypes carry 'counts' and 'means'")
        if counts.shape != (classes,) or means.ndim != 2 or means.shape[0] != classes:
            raise ProtocolError(Reason.BAD_SHAPE, f"prototypes {list(counts.shape)}/{list(means.shape)} for "
                                f"{classes} classes")
        if not np.issubdtype(counts.dtype, np.integer) or not np.issubdtype(means.dtype, np.floating):
            raise ProtocolError(Reason.BAD_DTYPE, f"prototypes of dtypes {counts.dtype}/{means.dtype}")
        if not np.isfinite(means).all():
            raise ProtocolError(Reason.NON_FINITE, "prototype means are not finite")
        if (counts < 0).any():
            raise ProtocolError(Reason.MALFORMED, "negative prototype counts")
        return counts.astype(np.int64), means.astype(np.float32)

    def _global_prototypes(self, feature_dim: int) -> Prototypes | None:
        if self.prototypes is not None and self.prototypes[1].shape[1] != feature_dim:
            log.warning("%s: global prototypes have %d features, the representation %d: ignored", self.client_id,
                        self.prototypes[1].shape[1], feature_dim)
            return None
        return self.prototypes

    # -- evaluation ------------------------------------------------------------------------
    def _on_evaluate(self, envelope: Envelope) -> None:
        if not self.current(envelope) or self.answered(envelope):
            return
        if PROTOTYPES in envelope.groups:
            self.prototypes = self._parse_prototypes(envelope)
        if self.ready:
            self._evaluate(envelope)
            return
        if self._answer_unverified(envelope):
            return
        self._waiting = envelope
        log.info("%s: evaluation of round %d waits for the artifact", self.client_id, envelope.round)
        if self.release is not None and self.release.sha256 not in self._failed:
            self._fetch(self.release)  # unless a request is in flight: its answer may have been lost

    def _answer_waiting(self) -> None:
        request, self._waiting = self._waiting, None
        if request is None or request.run_id != self.run_id or self.answered(request):
            return
        if self.ready:
            self._evaluate(request)
        elif not self._answer_unverified(request):
            self._waiting = request  # nothing deployed to answer with: as before, the request waits

    def _answer_unverified(self, request: Envelope) -> bool:
        """Answer `request` with the deployed model when the release failed verification (True);
        False when it did not fail, or nothing is deployed. The failed release scores 0: it
        classifies nothing."""
        release, deployed = self.release, self.deployed
        if release is None or release.sha256 not in self._failed or deployed is None:
            return False
        kept = f"verification failed: {self._failed[release.sha256]}"
        self._reply(request, 0.0, release, kept=kept)
        return True

    def _reply(self, request: Envelope, accuracy: float, release: Release, *, kept: str | None = None,
               groups: dict[str, Any] | None = None) -> None:
        """EVAL_RES: the accuracy of the `release` evaluated, what the device runs now and, when it
        kept an older model, why. Under DP the metrics go through `private_metrics`, without the
        deployed model's accuracy, and the reply says neither what the device runs nor why: whether
        it kept an older model is a comparison of accuracies on its data, which no mechanism noises.
        Under secure aggregation the metrics carry no count of its data."""
        deployed = self.deployed
        assert deployed is not None  # every answer follows a deployment, or keeps one
        config: dict[str, Any] = {"release": release.sha256}
        metrics = {"accuracy": accuracy, "num_test": self.data.num_test, "num_train": self.data.num_train}
        if self.privacy is not None:
            metrics = private_metrics(metrics, self.privacy, self.privacy.generator(self.client_id, request.round,
                                                                                    "evaluation"))
        else:
            config |= {"runs": deployed.sha256} | ({"kept": kept} if kept else {})
            metrics["deployed_accuracy"] = deployed.accuracy
        metrics = evaluation_figures(metrics, request.config, secure=self.secure_run)
        if self.secure_run and request.config.get(secagg_stages.SECURE) is True and groups:
            self._send_pool_share(request, groups[PROTOTYPES], metrics, config)
            return
        self.send(Kind.EVAL_RES, request.round, request=request, groups=groups or {}, metrics=metrics, config=config)

    def _representation(self) -> tuple[str, FeatureExtractor, bytes]:
        """The loaded representation: its sha256, its extractor and its ONNX bytes. Evaluation
        only runs once it is loaded (`ready`)."""
        if self._loaded is None or self._extractor is None or self._body is None:
            raise RuntimeError(f"{self.client_id}: evaluation before the released representation was loaded")
        return self._loaded, self._extractor, self._body

    def _embedded(self, sha: str, extractor: FeatureExtractor) -> tuple[np.ndarray, np.ndarray]:
        """Train and test features, embedded once per artifact."""
        if self._features is None or self._features[0] != sha:
            started = time.perf_counter()
            train = extractor.embed(self.data.train_x)
            test = extractor.embed(self.data.test_x)
            log.info("%s: %d samples embedded in %.2f s", self.client_id, len(train) + len(test),
                     time.perf_counter() - started)
            self._features = (sha, train, test)
        return self._features[1], self._features[2]

    def _evaluate(self, request: Envelope) -> None:
        sha, extractor, body = self._representation()
        release = self.release
        assert release is not None and release.sha256 == sha  # `ready`
        try:
            train, test = self._embedded(sha, extractor)
        except Exception as exc:  # onnxruntime's run errors share no base class below Exception
            self._fail(release, f"its feature extractor failed: {exc}")
            if not self._answer_unverified(request):
                self._waiting = request
            return
        classes = self.data.task.num_classes
        head = fit_head(self.head_kind, train, self.data.train_y, num_classes=classes,
                        prototypes=self._global_prototypes(train.shape[1]), seed=self.seed)
        predictions = head.predict(test)
        accuracy = float(np.mean(predictions == self.data.test_y)) if self.data.num_test else 0.0
        from .compose import compose  # onnx (15 MB resident) once the embedding's and the fit's memory is freed

        candidate = self.model_path.with_name(f".{self.model_path.name}.candidate")
        compose(body, head.to_onnx(train.shape[1]), candidate, num_classes=classes,
                metadata={"head": head.kind})  # compose keeps the body's metadata
        kept = self._deploy(candidate, release, accuracy, head.kind)
        groups = {}
        # under DP the class means stay home; under secure aggregation they go up only masked, when
        # the release phase's secure pool asks for them
        secure_pool = request.config.get(secagg_stages.SECURE) is True
        if self.share_prototypes and self.privacy is None and (not self.secure_run or secure_pool):
            counts, means = class_statistics(train, self.data.train_y, classes)
            groups[PROTOTYPES] = {"counts": counts, "means": means}
        self.evaluation = Evaluation(request.round, accuracy, head, predictions, self.model_path, deployed=kept is None)
        log.info("%s: %s head, accuracy %.4f on %d test examples", self.client_id, head.kind, accuracy,
                 self.data.num_test)
        self._reply(request, accuracy, release, kept=kept, groups=groups)

    def _deploy(self, candidate: Path, release: Release, accuracy: float, head: str) -> str | None:
        """Replace the deployed model with `candidate` and record it, unless the deployed one
        scored higher and this is no rollback: then discard `candidate` and return why."""
        deployed = self.deployed
        kept = kept_because(deployed, release.sha256, accuracy, rollback=release.rollback,
                            private=self.privacy is not None)
        if kept is not None:
            assert deployed is not None  # only a deployed model is kept
            candidate.unlink()
            release_log.info("%s: keeps release %s (accuracy %.4f on its own data) at %s: release %s scored %.4f",
                             self.client_id, deployed.describe(), deployed.accuracy, self.model_path,
                             release.describe(), accuracy)
            return kept
        os.replace(candidate, self.model_path)
        self.deployed = Deployment(release.sha256, release.version, accuracy, head, str(self.model_path))
        write_deployment(self.deployment_path, self.deployed)
        replaced = ("" if deployed is None or deployed.sha256 == release.sha256
                    else f"; release {deployed.describe()} scored {deployed.accuracy:.4f}")
        release_log.info("%s: deploys release %s%s (accuracy %.4f on its own data) to %s%s", self.client_id,
                         release.describe(), ", a rollback" if release.rollback else "", accuracy, self.model_path,
                         replaced)
        return None

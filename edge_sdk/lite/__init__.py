"""edgepfl for weak devices: a released ONNX representation, a small personal head, no PyTorch.

Install with `pip install "edgepfl[lite]"` (onnxruntime and onnx on top of the base install).
A `LiteClient` joins a federation over MQTT, fetches the run's released representation
(verified by sha256, cached on disk), embeds its own data with onnxruntime (`FeatureExtractor`),
fits a numpy head (`fit_head`, one of `HEADS`: linear SVM, logistic regression, MLP, or nearest
class mean with the federation's global prototypes), writes the personalized model as one ONNX
file and reports its accuracy. Nothing imported from here imports torch, scikit-learn or scipy.
"""

from .client import LiteClient
from .features import FeatureExtractor
from .heads import HEADS, class_statistics, fit_head

__all__ = ["HEADS", "FeatureExtractor", "LiteClient", "class_statistics", "fit_head"]

"""loracls: fine-tune a small decoder-only language model as a text classifier with LoRA."""

from loracls.config import TrainConfig
from loracls.errors import LoraclsError

__all__ = ["Classifier", "LoraclsError", "TrainConfig", "from_pretrained", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`loracls.from_pretrained`, `loracls.train` and `loracls.Classifier` without importing torch for every
    `import loracls`."""
    if name == "from_pretrained":
        from loracls.model import from_pretrained

        return from_pretrained
    if name == "train":
        from loracls.training.train import train

        return train
    if name == "Classifier":
        from loracls.inference.predict import Classifier

        return Classifier
    raise AttributeError(f"module 'loracls' has no attribute {name!r}")

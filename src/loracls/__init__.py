"""loracls: fine-tune a small decoder-only language model as a text classifier with LoRA."""

from loracls.config import TrainConfig
from loracls.errors import LoraclsError

__all__ = ["LoraclsError", "TrainConfig"]
__version__ = "0.1.0"
